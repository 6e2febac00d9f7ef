//! Finding the libcuda files to probe, in a way no workload can redirect.
//!
//! Uprobes attach to an inode, so a libcuda is a file, not a path: the host's library
//! bind-mounted into ten containers is one file and gets one set of probes. Files come from
//! `--libcuda` (the operator's: a bad one stops the agent), the usual host install paths, and
//! unless `--no-discover`, the processes' executable mappings.
//!
//! A discovered file is never looked up by path. Each file-backed executable mapping in
//! `/proc/<pid>/maps` ([`maps`]) is opened through `/proc/<pid>/map_files/<start>-<end>` (a
//! thread's, pinned, where the main thread exited alone: `thread_dir`): the
//! kernel hands over the very file mapped there, with no path walk a symlink or rename could
//! redirect (and no walk that could leave the process's root). It is opened `O_PATH` first and
//! `fstat`ed, so that nothing but a regular file is ever really opened (opening a device can
//! have effects), then re-opened for reading through the agent's own `/proc/self/fd/<n>`
//! with `O_NONBLOCK` (a tenant's lease cannot block the agent). The file is identified by
//! content ([`IDENTITY`]: a renamed copy of libcuda is a libcuda; a library merely named
//! `libcuda.so.1` is not), its exports read from the descriptor within fixed bounds
//! ([`elf`]), and the probes attached through `/proc/self/fd/<n>` by file offset
//! ([`Prober`]), the attached `(dev, ino)` checked against the `fstat` taken before (the
//! kernel resolves the agent's own descriptor, so they agree unless the agent's bookkeeping is
//! wrong: what cannot be redirected is the open through `map_files`).
//!
//! The verdict on each file is remembered by `(dev, ino)` and stamp ([`memo`]): a file that
//! failed to parse or attach, or that is not a libcuda, is not read again until it changes.
//! Work is bounded: at most [`PARSES_PER_CONTAINER_PER_SCAN`] new files are read per
//! container (cgroup) per scan, and at most `--max-probed-per-container` and
//! `--max-probed-files` discovered files get probes; a container past its cap is logged once
//! and counted (`vramguard_libcuda_files{state="capped"}`). A file's exports are read within
//! [`elf`]'s bounds of bytes and time (hash-table lookups, [`elf::TIME_BUDGET`]): a file over
//! them fails, and is remembered, like any other. A process's maps are streamed within the
//! bounds of [`crate::procmaps`]: a process over them is looked at up to the bound, reported
//! once (log, `discovery.maps_over_bound` and `skipped` in `vramguard audit`) and not read
//! again while it runs. No discovered file can stop the
//! agent: each failure is a log line, a count and an entry in `vramguard audit`'s `discovery`.
use std::{
    collections::{BTreeMap, BTreeSet, HashMap, VecDeque},
    fs::{self, File, OpenOptions},
    os::unix::fs::{MetadataExt, OpenOptionsExt},
    os::fd::AsRawFd,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

pub use crate::snapshot::{DiscoveryStats, SkippedFile};
use tracing::{debug, info, warn};

use crate::{
    cgroup,
    libcuda::{AttachReport, EXTMEM_PROBES, PROBES},
};

pub mod elf;
pub mod maps;
pub mod memo;

use memo::{Memo, Verdict};
pub use crate::libcuda::Stamp;

pub use crate::libcuda::{FileId, Opened, Prober};

/// The exports that make a file a libcuda: the driver's entry point and the basic allocation
/// pair. The hook (`libvramguard.so`) exports the allocation functions it interposes but
/// never `cuInit`, so it is not probed (its calls reach the real driver, which is).
pub const IDENTITY: [&str; 3] = ["cuInit", "cuMemAlloc_v2", "cuMemFree_v2"];

/// Where a host installs libcuda, probed (when they hold one) unless `--no-discover`.
const WELL_KNOWN: [&str; 4] = [
    "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
    "/usr/lib64/libcuda.so.1",
    "/usr/local/nvidia/lib64/libcuda.so.1",
    "/usr/lib/aarch64-linux-gnu/libcuda.so.1",
];

/// Paths the agent looked at for a libcuda, for error messages.
pub fn well_known_paths() -> String {
    WELL_KNOWN.join(", ")
}

/// Without the kernel's word on new mappings: how many [`Discovery::scan`]s make one that
/// reads every process's maps again.
pub const FULL_SCAN_EVERY: u64 = 10;

/// With it: how often every process's maps are read all the same (`--full-rescan-ms`), the
/// safety net for a mapping no event announced (see [`crate::kernel::exec`] for what has none).
pub const RESCAN_EVERY: Duration = Duration::from_secs(60);

/// How long after it first appears a process's maps are read at every scan: programs load
/// libcuda with `dlopen` at their first CUDA call (the CUDA runtime, PyTorch), some time
/// after they start.
pub const YOUNG: Duration = Duration::from_secs(60);

/// New (not remembered) files read per container per scan; the rest wait for a later scan.
pub const PARSES_PER_CONTAINER_PER_SCAN: usize = 16;

/// How many recent skipped files `vramguard audit` lists.
const RECENT_SKIPPED: usize = 32;

/// Why a file was looked at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// `--libcuda`.
    Operator,
    /// One of the usual host install paths.
    WellKnown,
    /// Mapped by host process `pid` of cgroup `cgroup` (0 if it could not be read).
    Process { pid: u32, cgroup: u64 },
}

impl Origin {
    fn describe(&self) -> String {
        match self {
            Origin::Operator => "--libcuda".into(),
            Origin::WellKnown => "well-known path".into(),
            Origin::Process { pid, .. } => format!("mapped by pid {pid}"),
        }
    }
}

/// What a file's exports say it is.
#[derive(Debug, PartialEq, Eq)]
pub enum Identity {
    /// The file offsets of the probed (and identifying) functions it exports.
    Libcuda(BTreeMap<&'static str, u64>),
    /// Which of [`IDENTITY`] it does not export.
    NotLibcuda(Vec<&'static str>),
}

/// Identifies the open file (of `size` bytes) by its exports.
pub fn identify(file: &File, size: u64) -> Result<Identity, elf::ElfError> {
    let mut wanted: Vec<&'static str> = PROBES.iter().map(|probe| probe.symbol).collect();
    wanted.extend(EXTMEM_PROBES.iter().map(|(symbol, ..)| *symbol));
    wanted.extend(IDENTITY);
    let found = elf::exported(file, size, &wanted)?;
    let missing: Vec<&'static str> = IDENTITY.into_iter().filter(|symbol| !found.contains_key(symbol)).collect();
    Ok(if missing.is_empty() { Identity::Libcuda(found) } else { Identity::NotLibcuda(missing) })
}

/// How many discovered files may get probes.
#[derive(Clone, Copy, Debug)]
pub struct Caps {
    pub per_container: usize,
    pub per_node: usize,
}

/// What looking at one file came to.
enum Outcome {
    Probed(AttachReport),
    NotLibcuda(Vec<&'static str>),
    Capped(&'static str),
    Failed(String),
}

/// The probed files and what discovery knows of every other file it has looked at.
pub struct Discovery {
    caps: Caps,
    memo: Memo,
    probed: BTreeMap<FileId, AttachReport>,
    /// Discovered files probed, per cgroup (their sum: the node's).
    per_cgroup: HashMap<u64, usize>,
    /// Cgroups (and the node, as `None`) logged as past their cap.
    capped_logged: BTreeSet<Option<u64>>,
    skipped: VecDeque<SkippedFile>,
    /// What scans learned of each process ([`Seen`]): of every running one after a scan of
    /// every process, and kept for the others between them.
    seen: HashMap<u32, Seen>,
    /// Processes to read at the next scan told by the kernel: those it named at this one (a
    /// mapping announced on entry to `mmap` may be made just after the read), and those
    /// with files that waited for a later scan (the per-container budget).
    recheck: BTreeSet<u32>,
    /// How often every process's maps are read however quiet the kernel is, and when they
    /// last were.
    rescan_every: Duration,
    last_rescan: Option<Instant>,
    /// What the current scan is for.
    why: Why,
    /// Maps read, by [`Why::index`].
    maps_read: [u64; 3],
    /// Scans of every process after the first; libcuda files they found (probed or capped)
    /// that no event led to; events the kernel lost (its map of processes full).
    rescans: u64,
    found_by_rescan: u64,
    events_lost: u64,
    /// Processes reported for maps over their bound.
    maps_over_bound: u64,
    /// Reads that panicked ([`DiscoveryStats::panicked`]).
    panicked: u64,
    scans: u64,
    /// Files whose exports were read (for tests of the memo).
    examined: u64,
}

/// What the kernel said since the last scan ([`crate::kernel::exec`]): the processes that may
/// have mapped a new executable file (an exec, an `mmap` of a file with `PROT_EXEC`, an
/// `mprotect` adding `PROT_EXEC`), and how many such events found its map full.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Told {
    pub pids: Vec<u32>,
    pub lost: u64,
}

/// What scans learned of one process.
#[derive(Clone, Copy, Debug)]
struct Seen {
    /// When a scan first saw it.
    first: Instant,
    /// Whether it was seen mapping a libcuda (a young process that has one is not read again
    /// until the next scan of every process, without the kernel's word).
    mapped: bool,
    /// Its start time, if its maps went over their bound (reported once, not read again
    /// while a process with that pid and start time runs).
    over: Option<u64>,
}

/// What reading one process's maps came to.
#[derive(Default)]
struct Read {
    /// One of its files is a libcuda (probed or capped).
    libcuda: bool,
    /// Its maps went over the bounds of [`crate::procmaps`] (then only the files before the
    /// bound were looked at, and the process is reported).
    over: bool,
    /// A file of it waits for a later scan (its container's budget was spent).
    waiting: bool,
    /// Its maps could not be opened: it is gone (or was never there).
    gone: bool,
}

/// Why a scan reads the maps it reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Why {
    /// Every process, with no event to miss: the first scan, and without the kernel's word,
    /// every [`FULL_SCAN_EVERY`]th.
    Everyone,
    /// The kernel named the processes.
    Event,
    /// Every process, the kernel's word notwithstanding: the safety net, or after events
    /// were lost.
    Rescan,
    /// Without the kernel's word: the processes that appeared in the last [`YOUNG`].
    New,
}

impl Why {
    /// As `vramguard_discovery_maps_read_total` labels it.
    fn name(self) -> &'static str {
        ["event", "rescan", "new"][self.index()]
    }

    /// Its place in [`Discovery::maps_read`] (a scan of everyone counts as a rescan).
    fn index(self) -> usize {
        match self {
            Why::Event => 0,
            Why::Everyone | Why::Rescan => 1,
            Why::New => 2,
        }
    }
}

impl Discovery {
    /// Every process's maps read every `every` when the kernel tells of new mappings
    /// ([`RESCAN_EVERY`] unless set).
    pub fn rescan_every(mut self, every: Duration) -> Discovery {
        self.rescan_every = every;
        self
    }

    pub fn new(caps: Caps) -> Discovery {
        Discovery {
            caps,
            memo: Memo::default(),
            probed: BTreeMap::new(),
            per_cgroup: HashMap::new(),
            capped_logged: BTreeSet::new(),
            skipped: VecDeque::new(),
            seen: HashMap::new(),
            recheck: BTreeSet::new(),
            rescan_every: RESCAN_EVERY,
            last_rescan: None,
            why: Why::Everyone,
            maps_read: [0; 3],
            rescans: 0,
            found_by_rescan: 0,
            events_lost: 0,
            maps_over_bound: 0,
            panicked: 0,
            scans: 0,
            examined: 0,
        }
    }

    /// The probed files.
    pub fn probed(&self) -> impl Iterator<Item = &AttachReport> {
        self.probed.values()
    }

    pub fn stats(&self) -> DiscoveryStats {
        DiscoveryStats {
            probed: self.probed.len() as u64,
            failed: self.memo.count(|v| matches!(v, Verdict::Failed(_))) as u64,
            capped: self.memo.count(|v| *v == Verdict::Capped) as u64,
            capped_containers: self.capped_logged.iter().filter(|c| c.is_some()).count() as u64,
            maps_over_bound: self.maps_over_bound,
            panicked: self.panicked,
            maps_read_event: self.maps_read[Why::Event.index()],
            maps_read_rescan: self.maps_read[Why::Rescan.index()],
            maps_read_new: self.maps_read[Why::New.index()],
            rescans: self.rescans,
            found_by_rescan: self.found_by_rescan,
            events_lost: self.events_lost,
            skipped: self.skipped.iter().cloned().collect(),
        }
    }

    /// Probes the operator's `--libcuda` file: any failure is an error.
    pub fn add_operator_file(&mut self, path: &Path, prober: &mut dyn Prober) -> Result<()> {
        let opened = open_path(path).with_context(|| format!("--libcuda {}", path.display()))?;
        if self.memo.probed(opened.id) {
            return Ok(());
        }
        match self.look_at(opened, Origin::Operator, prober) {
            Verdict::Probed => Ok(()),
            Verdict::NotLibcuda => bail!(
                "--libcuda {}: not a libcuda: it does not export {}",
                path.display(),
                IDENTITY.join(", ")
            ),
            Verdict::Failed(reason) => bail!("--libcuda {}: {reason}", path.display()),
            Verdict::Capped => bail!("--libcuda {}: refused by a cap (a bug: caps apply to discovered files only)", path.display()),
        }
    }

    /// Probes the libcuda files at the usual host install paths, and `installed` (the one
    /// found under the host's root, `crate::driver::install`); a bad one is logged.
    pub fn add_well_known(&mut self, installed: Option<&Path>, prober: &mut dyn Prober) {
        for path in installed.into_iter().chain(WELL_KNOWN.iter().map(Path::new)) {
            let opened = match open_path(path) {
                Ok(opened) => opened,
                Err(error) if error.downcast_ref::<std::io::Error>().map(std::io::Error::kind) == Some(std::io::ErrorKind::NotFound) => continue,
                Err(error) => {
                    warn!(path = %path.display(), error = %format!("{error:#}"), "skipped a well-known libcuda path");
                    continue;
                }
            };
            if !self.memo.probed(opened.id) {
                self.look_at(opened, Origin::WellKnown, prober);
            }
        }
    }

    /// Reads the maps of the processes due this scan and probes the libcuda files they map. A
    /// file already probed needs no finding: its probes cover every process that maps it,
    /// whenever it does.
    ///
    /// With the kernel's word (`told`, [`Told`]): the processes it names, and those it named at
    /// the last scan or whose files waited for a later scan ([`Discovery::recheck`]); every
    /// process at the first scan, every [`Discovery::rescan_every`] (the safety net), and at
    /// once after events were lost. Without it (`None`: the programs could not be attached),
    /// the timer's schedule: the processes that appeared in the last [`YOUNG`] and have not
    /// been seen mapping a libcuda yet, every process every [`FULL_SCAN_EVERY`]th scan.
    pub fn scan(&mut self, told: Option<Told>, prober: &mut dyn Prober) {
        self.scan_of(told, running_pids, prober);
    }

    /// [`Discovery::scan`], with `everyone` listing the processes a scan of every process
    /// reads.
    fn scan_of(&mut self, told: Option<Told>, everyone: impl FnOnce() -> Vec<u32>, prober: &mut dyn Prober) {
        let now = Instant::now();
        let first = self.scans == 0;
        self.scans += 1;
        let Some(told) = told else {
            let full = first || (self.scans - 1).is_multiple_of(FULL_SCAN_EVERY);
            let why = if full { Why::Everyone } else { Why::New };
            if full {
                self.last_rescan = Some(now);
            }
            self.scan_among(everyone(), why, now, prober);
            return;
        };
        self.events_lost += told.lost;
        let due = now.checked_sub(self.rescan_every).is_none_or(|due| self.last_rescan.is_none_or(|last| last <= due));
        if first || told.lost > 0 || due {
            if told.lost > 0 {
                warn!(lost = told.lost, "the kernel's word on new executable mappings was lost: every process's maps read now");
            }
            self.recheck.clear();
            self.last_rescan = Some(now);
            // Not the first (before which there were no events to miss): what it finds, no
            // event announced.
            let why = if first { Why::Everyone } else { Why::Rescan };
            self.rescans += u64::from(why == Why::Rescan);
            self.scan_among(everyone(), why, now, prober);
            return;
        }
        // Read again at the next scan: a mapping announced on entry to `mmap` may be made
        // just after this read.
        let again: BTreeSet<u32> = told.pids.iter().copied().collect();
        let mut pids = std::mem::take(&mut self.recheck);
        pids.extend(told.pids);
        self.scan_among(pids.into_iter().collect(), Why::Event, now, prober);
        self.recheck.extend(again);
    }

    /// Reads the maps of `pids` that are due (`why`), remembering what it found of each.
    fn scan_among(&mut self, pids: Vec<u32>, why: Why, now: Instant, prober: &mut dyn Prober) {
        self.why = why;
        // (dev, ino) as the maps report them -> whether the file is a libcuda (probed or
        // capped): each file is looked at once per scan however many processes map it.
        let mut looked: HashMap<FileId, bool> = HashMap::new();
        let mut budget: HashMap<u64, usize> = HashMap::new();
        let everyone = matches!(why, Why::Everyone | Why::Rescan | Why::New);
        let mut seen = if everyone { HashMap::with_capacity(pids.len()) } else { std::mem::take(&mut self.seen) };
        for pid in pids {
            let mut known = self.seen.remove(&pid).or_else(|| seen.remove(&pid)).unwrap_or(Seen { first: now, mapped: false, over: None });
            if let Some(start) = known.over {
                // Over its bound: not read again while it runs (a new process with its pid is).
                if ledger::process::running_start_time_of(pid) == Some(start) {
                    seen.insert(pid, known);
                    continue;
                }
                known = Seen { first: now, mapped: false, over: None };
            }
            let young = now.saturating_duration_since(known.first) < YOUNG;
            // Without the kernel's word, a process is read while young until seen mapping a libcuda.
            if why == Why::New && (known.mapped || !young) {
                seen.insert(pid, known);
                continue;
            }
            self.maps_read[why.index()] += 1;
            debug!(pid, reason = why.name(), "reading a process's maps");
            let scanned = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.scan_process(pid, &mut looked, &mut budget, prober)
            }));
            let over = match scanned {
                // Not remembered until the next scan of every process (which forgets the gone
                // ones): the kernel names every process that execs or maps code, most of them
                // short-lived, and a process storm would otherwise grow what is kept.
                Ok(read) if read.gone && why == Why::Event => continue,
                Ok(read) => {
                    known.mapped |= read.libcuda;
                    if read.waiting {
                        self.recheck.insert(pid);
                    }
                    read.over
                }
                Err(panic) => {
                    // Not read again while it runs, like a process over its bounds.
                    self.panicked += 1;
                    let reason = format!("reading its maps panicked: {}", crate::task::panic_message(&*panic));
                    warn!(pid, %reason, "skipped a process");
                    self.note_skipped(&format!("/proc/{pid}/maps"), (0, 0), Origin::Process { pid, cgroup: 0 }, reason);
                    true
                }
            };
            if over {
                known.over = Some(ledger::process::running_start_time_of(pid).unwrap_or(0));
            }
            seen.insert(pid, known);
        }
        // A scan of every process forgets the processes gone; one of some keeps the others.
        if !everyone {
            seen.extend(self.seen.drain());
        }
        self.seen = seen;
    }

    /// Looks at every executable file `pid` maps ([`Read`]).
    fn scan_process(
        &mut self,
        pid: u32,
        looked: &mut HashMap<FileId, bool>,
        budget: &mut HashMap<u64, usize>,
        prober: &mut dyn Prober,
    ) -> Read {
        let mut cgroup = None;
        let mut has = false;
        let mut waiting = false;
        // A process whose main thread exited alone shows an empty maps under its pid (the
        // kernel lets go of a thread's address space at its exit): one of its threads shows
        // it, its maps and its map_files alike (`space`, pinned by `thread`).
        let mut space = format!("/proc/{pid}");
        let mut thread = None;
        let read = loop {
            // Processes come and go while we scan: an unreadable maps file is skipped.
            let Ok(file) = File::open(format!("{space}/maps")) else {
                return Read { gone: true, ..Read::default() };
            };
            let read = maps::executable_files(file, |mapping| {
                let key = (mapping.dev, mapping.ino);
                if let Some(libcuda) = looked.get(&key) {
                    has |= libcuda;
                    return;
                }
                if self.memo.probed(key) {
                    looked.insert(key, true);
                    has = true;
                    return;
                }
                // (Each file comes once per process: a file that must wait for a later scan is
                // not tried again for each of its mappings.)
                let Some(verdict) = self.look_at_mapping(pid, &space, mapping, &mut cgroup, budget, &mut waiting, prober) else {
                    return;
                };
                let libcuda = matches!(verdict, Verdict::Probed | Verdict::Capped);
                looked.insert(key, libcuda);
                has |= libcuda;
            });
            match read {
                Ok(summary) if summary.bytes == 0 && thread.is_none() => match thread_dir(pid) {
                    Some((dir, path)) => (thread, space) = (Some(dir), path),
                    None => break Ok(summary),
                },
                read => break read,
            }
        };
        let over = match read {
            Ok(summary) => summary.over,
            Err(_) => None, // gone while it was read
        };
        if let Some(bound) = over {
            let cgroup = *cgroup.get_or_insert_with(|| cgroup::id_of_pid(pid).unwrap_or(0));
            let reason = format!("{bound}: only the files mapped before it were looked at");
            warn!(pid, cgroup, %reason, "a process's maps are over the bound (not read again while it runs)");
            self.maps_over_bound += 1;
            self.note_skipped(&format!("/proc/{pid}/maps"), (0, 0), Origin::Process { pid, cgroup }, reason);
        }
        Read { libcuda: has, over: over.is_some(), waiting, gone: false }
    }

    /// Opens the file mapped at `mapping` in process `pid` and decides about it, unless it is
    /// remembered; `None` when it could not be opened (gone) or must wait for a later scan
    /// (budget: then `waits` is set). `space` is the directory whose `map_files` show the
    /// process's address space: `/proc/<pid>`, or one of its threads' ([`thread_dir`]).
    #[allow(clippy::too_many_arguments)]
    fn look_at_mapping(
        &mut self,
        pid: u32,
        space: &str,
        mapping: &maps::Mapping<'_>,
        cgroup: &mut Option<u64>,
        budget: &mut HashMap<u64, usize>,
        waits: &mut bool,
        prober: &mut dyn Prober,
    ) -> Option<Verdict> {
        let link = format!("{space}/map_files/{}", mapping.map_files_name());
        // O_PATH: nothing is opened yet (no open handler runs, no lease is broken).
        let handle = OpenOptions::new().read(true).custom_flags(libc::O_PATH).open(&link).ok()?;
        let metadata = handle.metadata().ok()?;
        if !metadata.file_type().is_file() {
            return Some(Verdict::NotLibcuda);
        }
        let id = (metadata.dev(), metadata.ino());
        let stamp = Stamp::of(&metadata);
        if let Some(verdict) = self.memo.get(id, stamp) {
            return Some(verdict.clone());
        }
        let cgroup = *cgroup.get_or_insert_with(|| cgroup::id_of_pid(pid).unwrap_or(0));
        let left = budget.entry(cgroup).or_insert(PARSES_PER_CONTAINER_PER_SCAN);
        if *left == 0 {
            debug!(pid, cgroup, "discovery budget of this container spent for this scan: the rest waits");
            *waits = true;
            return None;
        }
        *left -= 1;
        let origin = Origin::Process { pid, cgroup };
        let opened = match reopen(&handle, id) {
            Ok(file) => Opened { file, id, stamp, shown: mapping.path.to_string() },
            Err(error) => {
                let reason = format!("cannot open it: {error}");
                self.remember(id, stamp, mapping.path, origin, Verdict::Failed(reason.clone()));
                warn!(path = ?mapping.path, dev = id.0, ino = id.1, pid, %reason, "skipped a mapped file");
                return Some(Verdict::Failed(reason));
            }
        };
        let verdict = self.look_at(opened, origin, prober);
        if self.why == Why::Rescan && matches!(verdict, Verdict::Probed | Verdict::Capped) {
            self.found_by_rescan += 1;
            warn!(path = ?mapping.path, dev = id.0, ino = id.1, pid, "a libcuda found by the rescan: no event of the kernel's led to it");
        }
        Some(verdict)
    }

    /// Identifies the open file, applies the caps, attaches, logs, and remembers the verdict.
    fn look_at(&mut self, opened: Opened, origin: Origin, prober: &mut dyn Prober) -> Verdict {
        let outcome = self.examine(&opened, origin, prober);
        let (id, stamp, shown) = (opened.id, opened.stamp, opened.shown.as_str());
        let pid = match origin {
            Origin::Process { pid, .. } => Some(pid),
            _ => None,
        };
        let verdict = match outcome {
            Outcome::Probed(mut report) => {
                info!(
                    path = ?shown, dev = id.0, ino = id.1, origin = %origin.describe(),
                    attached = report.attached.len(), missing = ?report.missing, aliases = ?report.aliases, links = %report.links,
                    "probes attached to libcuda"
                );
                report.dev = id.0;
                report.ino = id.1;
                report.origin = origin.describe();
                if let Origin::Process { cgroup, .. } = origin {
                    report.cgroup = Some(cgroup);
                    *self.per_cgroup.entry(cgroup).or_default() += 1;
                }
                self.probed.insert(id, report);
                Verdict::Probed
            }
            Outcome::NotLibcuda(missing) => {
                if looks_like_libcuda(shown) {
                    let reason = format!("named like a libcuda but does not export {}", missing.join(", "));
                    info!(path = ?shown, dev = id.0, ino = id.1, ?pid, %reason, "skipped a mapped file");
                    self.note_skipped(shown, id, origin, reason);
                }
                Verdict::NotLibcuda
            }
            Outcome::Capped(scope) => {
                let (key, cap) = match (scope, origin) {
                    ("container", Origin::Process { cgroup, .. }) => (Some(cgroup), self.caps.per_container),
                    _ => (None, self.caps.per_node),
                };
                let reason = format!("the {scope}'s cap of {cap} probed libcuda files is reached");
                if self.capped_logged.insert(key) {
                    warn!(path = ?shown, dev = id.0, ino = id.1, ?pid, cgroup = ?key, %reason, "libcuda not probed (logged once per container)");
                }
                self.note_skipped(shown, id, origin, reason);
                Verdict::Capped
            }
            Outcome::Failed(reason) => {
                warn!(path = ?shown, dev = id.0, ino = id.1, origin = %origin.describe(), %reason, "skipped a mapped file");
                self.note_skipped(shown, id, origin, reason.clone());
                Verdict::Failed(reason)
            }
        };
        self.memo.put(id, stamp, verdict.clone());
        verdict
    }

    fn examine(&mut self, opened: &Opened, origin: Origin, prober: &mut dyn Prober) -> Outcome {
        self.examined += 1;
        let identified = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            if crate::fault::panics_on_file(&opened.shown) {
                panic!("fault injected: discovery panics on {}", opened.shown);
            }
            identify(&opened.file, opened.stamp.size)
        }));
        let identified = match identified {
            Ok(identified) => identified,
            Err(panic) => {
                self.panicked += 1;
                return Outcome::Failed(format!("reading it panicked: {}", crate::task::panic_message(&*panic)));
            }
        };
        let offsets = match identified {
            Err(error) => return Outcome::Failed(error.to_string()),
            Ok(Identity::NotLibcuda(missing)) => return Outcome::NotLibcuda(missing),
            Ok(Identity::Libcuda(offsets)) => offsets,
        };
        if let Origin::Process { cgroup, .. } = origin {
            if self.per_cgroup.values().sum::<usize>() >= self.caps.per_node {
                return Outcome::Capped("node");
            }
            if self.per_cgroup.get(&cgroup).copied().unwrap_or(0) >= self.caps.per_container {
                return Outcome::Capped("container");
            }
        }
        match prober.attach(opened, &offsets) {
            Ok(report) => Outcome::Probed(report),
            Err(error) => Outcome::Failed(format!("{error:#}")),
        }
    }

    fn remember(&mut self, id: FileId, stamp: Stamp, shown: &str, origin: Origin, verdict: Verdict) {
        if let Verdict::Failed(reason) = &verdict {
            self.note_skipped(shown, id, origin, reason.clone());
        }
        self.memo.put(id, stamp, verdict);
    }

    fn note_skipped(&mut self, shown: &str, id: FileId, origin: Origin, reason: String) {
        if self.skipped.len() == RECENT_SKIPPED {
            self.skipped.pop_front();
        }
        self.skipped.push_back(SkippedFile { path: shown.to_string(), dev: id.0, ino: id.1, origin: origin.describe(), reason });
    }

    /// Makes the next scan with the kernel's word a rescan.
    #[cfg(test)]
    fn rescan_due(&mut self) {
        self.last_rescan = None;
    }

    /// Makes every process known to the last scan older than [`YOUNG`].
    #[cfg(test)]
    fn age(&mut self) {
        for seen in self.seen.values_mut() {
            seen.first = seen.first.checked_sub(YOUNG).unwrap_or(seen.first);
        }
    }
}

/// Opens a trusted path (`--libcuda`, a well-known path) for reading.
fn open_path(path: &Path) -> Result<Opened> {
    let file = OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path)?;
    let metadata = file.metadata()?;
    if !metadata.file_type().is_file() {
        bail!("not a regular file");
    }
    Ok(Opened {
        id: (metadata.dev(), metadata.ino()),
        stamp: Stamp::of(&metadata),
        file,
        shown: path.display().to_string(),
    })
}

/// Opens for reading the file an `O_PATH` handle names, through the agent's own
/// `/proc/self/fd` (the same file, whatever has happened to its paths since); fails unless
/// it is still the file `id`.
fn reopen(handle: &File, id: FileId) -> std::io::Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(format!("/proc/self/fd/{}", handle.as_raw_fd()))?;
    let metadata = file.metadata()?;
    if (metadata.dev(), metadata.ino()) != id {
        return Err(std::io::Error::other("the file changed while it was opened"));
    }
    Ok(file)
}

/// Where process `pid`'s main thread exited alone (its `/proc/<pid>/maps` and `map_files` are
/// empty), a directory showing its address space: one of its threads' `/proc/<tid>`
/// (`map_files` is there, not under `task/`), opened and checked through the descriptor to be
/// `pid`'s (`Tgid:` of its `status`: the zombie leader pins its pid, not its threads' ids, and
/// a tid may be another process's by now), and named through the descriptor
/// (`/proc/self/fd/<n>`), so that every later open resolves in that thread's directory or
/// fails. The descriptor pins it while the caller holds it.
fn thread_dir(pid: u32) -> Option<(File, String)> {
    if !ledger::process::has_other_threads(pid) {
        return None;
    }
    ledger::process::other_threads(pid, crate::procmaps::THREADS_TRIED).into_iter().find_map(|tid| {
        let dir = File::open(format!("/proc/{tid}")).ok()?;
        let path = format!("/proc/self/fd/{}", dir.as_raw_fd());
        let status = fs::read_to_string(format!("{path}/status")).ok()?;
        let tgid = status.lines().find_map(|line| line.strip_prefix("Tgid:"))?.trim().parse::<u32>().ok()?;
        (tgid == pid).then_some((dir, path))
    })
}

/// `libcuda.so`, `libcuda.so.1`, `libcuda.so.580.159`, ... (only to decide what is worth a
/// log line: identification is by content).
fn looks_like_libcuda(path: &str) -> bool {
    let name = path.trim_end_matches(" (deleted)").rsplit('/').next().unwrap_or("");
    name == "libcuda.so" || name.starts_with("libcuda.so.")
}

/// The pids in /proc now.
fn running_pids() -> Vec<u32> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries.flatten().filter_map(|entry| entry.file_name().to_str().and_then(|name| name.parse().ok())).collect()
}

#[cfg(test)]
mod tests;
pub mod task;
