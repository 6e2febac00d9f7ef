//! Discovery against this test process's own mappings, with a [`Prober`] that records what
//! it is asked to attach (the eBPF side is covered by the end-to-end tests).
use std::{path::PathBuf, sync::Mutex};

use super::*;
use crate::discovery::elf::tests::{Scratch, LIBCUDA_LIKE};

/// The tests map files into this one process, and each scan reads all of its mappings: one
/// test at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Records the files it attaches to; fails for the inodes in `refuse`.
#[derive(Default)]
struct Recorder {
    attached: Vec<FileId>,
    calls: usize,
    refuse: Vec<FileId>,
}

impl Prober for Recorder {
    fn attach(&mut self, file: &Opened, offsets: &BTreeMap<&'static str, u64>) -> Result<AttachReport> {
        self.calls += 1;
        if self.refuse.contains(&file.id) {
            bail!("refused by the test");
        }
        assert!(offsets.contains_key("cuMemAlloc_v2") && offsets.contains_key("cuMemFree_v2"));
        self.attached.push(file.id);
        Ok(AttachReport { path: file.shown.clone(), attached: offsets.keys().map(|s| s.to_string()).collect(), ..Default::default() })
    }
}

fn id_of(path: &PathBuf) -> FileId {
    let metadata = fs::metadata(path).expect("stat");
    (metadata.dev(), metadata.ino())
}

/// Maps `path` executable into this process, as the dynamic loader maps a library's code.
fn map_exec(path: &PathBuf) -> memmap2::Mmap {
    let file = File::open(path).expect("open");
    // SAFETY: a private read-only mapping of a file this test owns and does not truncate.
    unsafe { memmap2::MmapOptions::new().map_exec(&file) }.expect("map")
}

fn caps(per_container: usize, per_node: usize) -> Caps {
    Caps { per_container, per_node }
}

/// A scan without the kernel's word (the timer's schedule) of this process alone.
fn scan(discovery: &mut Discovery, prober: &mut Recorder) {
    discovery.scan_of(None, || vec![std::process::id()], prober);
}

/// A scan with the kernel's word: `pids` named since the last one, `lost` events lost; a scan
/// of every process reads this one and `others`.
fn told_scan(discovery: &mut Discovery, pids: &[u32], lost: u64, others: &[u32], prober: &mut Recorder) {
    let everyone = || std::iter::once(std::process::id()).chain(others.iter().copied()).collect();
    discovery.scan_of(Some(Told { pids: pids.to_vec(), lost }), everyone, prober);
}

/// Maps read so far, by reason: (event, rescan, new).
fn reads(discovery: &Discovery) -> (u64, u64, u64) {
    let stats = discovery.stats();
    (stats.maps_read_event, stats.maps_read_rescan, stats.maps_read_new)
}

#[test]
fn identifies_libcuda_by_its_exports_whatever_its_name() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let scratch = Scratch::new("identify");
    let renamed = scratch.library("libnotcuda.so", &LIBCUDA_LIKE);
    // What the hook exports: the allocation functions, never cuInit.
    let interposer = scratch.library("libcuda.so.1", &["cuMemAlloc_v2", "cuMemFree_v2", "cuMemCreate"]);
    let other = scratch.library("libother.so", &["compute", "cuInit"]);
    let size = |p: &PathBuf| fs::metadata(p).expect("stat").len();
    let open = |p: &PathBuf| File::open(p).expect("open");
    assert!(matches!(identify(&open(&renamed), size(&renamed)), Ok(Identity::Libcuda(_))));
    assert_eq!(identify(&open(&interposer), size(&interposer)).ok(), Some(Identity::NotLibcuda(vec!["cuInit"])));
    assert_eq!(
        identify(&open(&other), size(&other)).ok(),
        Some(Identity::NotLibcuda(vec!["cuMemAlloc_v2", "cuMemFree_v2"]))
    );

    let maps = [map_exec(&renamed), map_exec(&interposer), map_exec(&other)];
    let mut discovery = Discovery::new(caps(4, 64));
    let mut prober = Recorder::default();
    scan(&mut discovery, &mut prober);
    assert_eq!(prober.attached, vec![id_of(&renamed)], "only the renamed libcuda is probed");
    let report = discovery.probed().next().expect("a probed file");
    assert_eq!((report.dev, report.ino), id_of(&renamed));
    assert_eq!(report.origin, format!("mapped by pid {}", std::process::id()));
    assert!(report.path.ends_with("libnotcuda.so"), "{report:?}");
    let stats = discovery.stats();
    assert_eq!(stats.probed, 1);
    // The interposer is named libcuda.so.1: worth a line saying why it was not probed.
    assert_eq!(stats.skipped.len(), 1, "{stats:?}");
    assert!(stats.skipped[0].reason.contains("does not export cuInit"), "{stats:?}");
    drop(maps);
}

#[test]
fn a_bad_file_is_read_once_until_it_changes() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let scratch = Scratch::new("memo");
    let junk = scratch.0.join("libcuda.so.1");
    fs::write(&junk, vec![0x5a; 8192]).expect("write");
    let library = scratch.library("libx.so", &LIBCUDA_LIKE);
    let mut prober = Recorder { refuse: vec![id_of(&library)], ..Default::default() };
    let maps = [map_exec(&junk), map_exec(&library)];
    let mut discovery = Discovery::new(caps(4, 64));
    scan(&mut discovery, &mut prober);
    let examined = discovery.examined;
    assert!(examined >= 2, "both files read");
    assert_eq!(prober.calls, 1, "the library identified and offered to the prober, which refused");
    let stats = discovery.stats();
    assert_eq!(stats.failed, 2, "{stats:?}");
    assert!(stats.skipped.iter().any(|s| s.path.ends_with("libcuda.so.1") && s.reason.contains("not a 64-bit ELF")), "{stats:?}");
    assert!(stats.skipped.iter().any(|s| s.reason.contains("refused by the test")), "{stats:?}");

    for _ in 0..FULL_SCAN_EVERY {
        scan(&mut discovery, &mut prober);
    }
    assert_eq!(discovery.examined, examined, "remembered failures are not read again");
    assert_eq!(prober.calls, 1, "nor attached again");

    // Rewritten in place (same inode): a new file, read again.
    let mut bytes = vec![0x5a; 8192];
    bytes[0] = 0x7f;
    fs::write(&junk, &bytes).expect("rewrite");
    for _ in 0..FULL_SCAN_EVERY {
        scan(&mut discovery, &mut prober);
    }
    assert_eq!(discovery.examined, examined + 1, "the changed file read once more");
    drop(maps);
}

#[test]
fn caps_bound_the_files_probed_per_container_and_per_node() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let scratch = Scratch::new("caps");
    let copies: Vec<PathBuf> = (0..3).map(|i| scratch.library(&format!("libcopy{i}.so"), &LIBCUDA_LIKE)).collect();
    let maps: Vec<_> = copies.iter().map(map_exec).collect();

    let mut discovery = Discovery::new(caps(2, 64));
    let mut prober = Recorder::default();
    scan(&mut discovery, &mut prober);
    assert_eq!(prober.attached.len(), 2, "two of the container's three copies");
    let stats = discovery.stats();
    assert_eq!((stats.capped, stats.capped_containers), (1, 1), "{stats:?}");
    assert!(stats.skipped.iter().any(|s| s.reason.contains("container's cap of 2")), "{stats:?}");
    for _ in 0..FULL_SCAN_EVERY {
        scan(&mut discovery, &mut prober);
    }
    assert_eq!(prober.attached.len(), 2, "a capped file stays unprobed");
    assert_eq!(discovery.stats().capped, 1, "and is counted once");

    let mut discovery = Discovery::new(caps(4, 1));
    let mut prober = Recorder::default();
    scan(&mut discovery, &mut prober);
    assert_eq!(prober.attached.len(), 1, "the node's cap");
    let stats = discovery.stats();
    assert_eq!((stats.capped, stats.capped_containers), (2, 0), "{stats:?}");
    drop(maps);
}

#[test]
fn operator_files_are_fatal_when_wrong_and_uncapped() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let scratch = Scratch::new("operator");
    let junk = scratch.0.join("libcuda.so.1");
    fs::write(&junk, b"not a library").expect("write");
    let interposer = scratch.library("libhook.so", &["cuMemAlloc_v2", "cuMemFree_v2"]);
    let library = scratch.library("libcuda.so.580", &LIBCUDA_LIKE);
    let mut discovery = Discovery::new(caps(0, 0));
    let mut prober = Recorder::default();
    let error = discovery.add_operator_file(&junk, &mut prober).expect_err("not an ELF file");
    assert!(format!("{error:#}").contains("not a 64-bit ELF"), "{error:#}");
    let error = discovery.add_operator_file(&interposer, &mut prober).expect_err("not a libcuda");
    assert!(format!("{error:#}").contains("does not export cuInit"), "{error:#}");
    let error = discovery.add_operator_file(&scratch.0.join("missing"), &mut prober).expect_err("missing");
    assert!(format!("{error:#}").contains("missing"), "{error:#}");
    discovery.add_operator_file(&library, &mut prober).expect("a libcuda, whatever the caps");
    discovery.add_operator_file(&library, &mut prober).expect("twice is once");
    assert_eq!(prober.attached, vec![id_of(&library)]);
}

#[test]
fn discovery_reads_new_processes_and_every_process_on_full_scans() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let scratch = Scratch::new("young");
    let library = scratch.library("libcuda.so.1", &LIBCUDA_LIKE);
    let mut discovery = Discovery::new(caps(64, 64));
    let mut prober = Recorder::default();
    scan(&mut discovery, &mut prober);
    assert!(prober.attached.is_empty(), "a full scan before this process maps the file");
    // This process maps a libcuda after it started (as dlopen would).
    let map = map_exec(&library);
    scan(&mut discovery, &mut prober);
    assert_eq!(prober.attached.len(), 1, "a young process's maps are read at every scan");
    drop(map);

    // An old process maps a new libcuda: only the full scan reads its maps.
    let second = scratch.library("libcuda.so.2", &LIBCUDA_LIKE);
    discovery.age();
    let map = map_exec(&second);
    for scan_number in 2..FULL_SCAN_EVERY {
        scan(&mut discovery, &mut prober);
        assert_eq!(prober.attached.len(), 1, "scan {scan_number} reads only young processes");
    }
    scan(&mut discovery, &mut prober);
    assert_eq!(prober.attached.len(), 2, "the full scan finds it");
    drop(map);
}

/// A child process that maps the first page of `file` `count` times (each its own line of
/// its maps), then waits to be killed.
struct Bloated(libc::pid_t);

impl Bloated {
    fn start(file: &File, count: usize) -> Bloated {
        use std::os::fd::AsRawFd;
        let mut pipe = [0; 2];
        // SAFETY: pipe(2) into a two-int array.
        assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
        // SAFETY: the child calls only mmap, write, pause and _exit (async-signal-safe), on
        // descriptors opened before the fork.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork");
        if pid == 0 {
            for _ in 0..count {
                // SAFETY: a new private read-only mapping of an open file, never used.
                let at = unsafe { libc::mmap(std::ptr::null_mut(), 4096, libc::PROT_READ, libc::MAP_PRIVATE, file.as_raw_fd(), 0) };
                if at == libc::MAP_FAILED {
                    // SAFETY: ends the child at once.
                    unsafe { libc::_exit(1) };
                }
            }
            // SAFETY: one byte to the pipe, then wait for the parent's SIGKILL.
            unsafe {
                libc::write(pipe[1], [1u8].as_ptr().cast(), 1);
                loop {
                    libc::pause();
                }
            }
        }
        let mut byte = [0u8];
        // SAFETY: reads one byte into a local buffer; closes our copies of the pipe.
        unsafe {
            libc::close(pipe[1]);
            assert_eq!(libc::read(pipe[0], byte.as_mut_ptr().cast(), 1), 1, "the child mapped the file");
            libc::close(pipe[0]);
        }
        Bloated(pid)
    }
}

impl Drop for Bloated {
    fn drop(&mut self) {
        // SAFETY: kill and reap our own child.
        unsafe {
            libc::kill(self.0, libc::SIGKILL);
            libc::waitpid(self.0, std::ptr::null_mut(), 0);
        }
    }
}

#[test]
fn a_process_with_maps_over_the_bound_is_reported_once_and_not_read_again() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let scratch = Scratch::new("bloat");
    // A path of about 3.8 KB: 15 directories of 250 characters.
    let mut deep = scratch.0.clone();
    for i in 0..15 {
        deep.push(format!("{i:02}{}", "d".repeat(248)));
    }
    fs::create_dir_all(&deep).expect("mkdir");
    let page = deep.join("page");
    fs::write(&page, [0u8; 4096]).expect("write");
    let file = File::open(&page).expect("open");
    let line = page.as_os_str().len() + 80;
    let over = Bloated::start(&file, crate::procmaps::MAX_BYTES as usize / line + 100);
    let under = Bloated::start(&file, 100);

    let mut discovery = Discovery::new(caps(4, 64));
    let mut prober = Recorder::default();
    let both = || vec![under.0 as u32, over.0 as u32];
    discovery.scan_of(None, both, &mut prober);
    let stats = discovery.stats();
    assert_eq!(stats.maps_over_bound, 1, "{stats:?}");
    let reported: Vec<_> = stats.skipped.iter().filter(|s| s.path.ends_with("/maps")).collect();
    assert_eq!(reported.len(), 1, "only the process over the bound: {stats:?}");
    assert_eq!(reported[0].path, format!("/proc/{}/maps", over.0));
    assert!(reported[0].reason.contains("over the agent's bound of"), "{stats:?}");
    for _ in 0..FULL_SCAN_EVERY {
        discovery.scan_of(None, both, &mut prober);
    }
    assert_eq!(discovery.stats().maps_over_bound, 1, "not read (nor reported) again while it runs");
    // Nor on the kernel's word, nor by a rescan.
    let before = reads(&discovery);
    told_scan(&mut discovery, &[over.0 as u32], 0, &[], &mut prober);
    discovery.rescan_due();
    told_scan(&mut discovery, &[], 0, &[over.0 as u32], &mut prober);
    assert_eq!(reads(&discovery), (before.0, before.1 + 1, before.2), "only this process read, by the rescan");
    assert_eq!(discovery.stats().maps_over_bound, 1);
}

#[test]
fn told_by_the_kernel_discovery_reads_only_the_processes_it_names() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let scratch = Scratch::new("told");
    let library = scratch.library("libnotcuda.so", &LIBCUDA_LIKE);
    let file = File::open(&library).expect("open");
    // Processes that change nothing: two children that mapped a page and wait.
    let idle = [Bloated::start(&file, 1), Bloated::start(&file, 1)];
    let others: Vec<u32> = idle.iter().map(|b| b.0 as u32).collect();
    let mut discovery = Discovery::new(caps(4, 64));
    let mut prober = Recorder::default();
    told_scan(&mut discovery, &[], 0, &others, &mut prober);
    assert_eq!(reads(&discovery), (0, 3, 0), "the first scan reads every process");
    for _ in 0..3 * FULL_SCAN_EVERY {
        told_scan(&mut discovery, &[], 0, &others, &mut prober);
    }
    assert_eq!(reads(&discovery), (0, 3, 0), "a quiet node: no maps read, no process listed");
    assert!(prober.attached.is_empty());

    // This process maps a renamed libcuda (as dlopen would) and the kernel says so.
    let map = map_exec(&library);
    let me = std::process::id();
    told_scan(&mut discovery, &[me], 0, &others, &mut prober);
    assert_eq!(prober.attached, vec![id_of(&library)], "found by the event");
    assert_eq!(reads(&discovery), (1, 3, 0), "this process alone read");
    told_scan(&mut discovery, &[], 0, &others, &mut prober);
    assert_eq!(reads(&discovery), (2, 3, 0), "and once more at the next scan (a mapping announced on entry to mmap)");
    for _ in 0..FULL_SCAN_EVERY {
        told_scan(&mut discovery, &[], 0, &others, &mut prober);
    }
    assert_eq!(reads(&discovery), (2, 3, 0), "then not again");
    let stats = discovery.stats();
    assert_eq!((stats.rescans, stats.found_by_rescan, stats.events_lost), (0, 0, 0), "{stats:?}");
    drop(map);
}

#[test]
fn the_rescan_finds_what_no_event_announced_and_counts_it() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let scratch = Scratch::new("rescan");
    let mut discovery = Discovery::new(caps(4, 64));
    let mut prober = Recorder::default();
    told_scan(&mut discovery, &[], 0, &[], &mut prober);
    // Mapped without a word from the kernel (what it has no event for, or an event missed).
    let first = scratch.library("libquiet.so", &LIBCUDA_LIKE);
    let map = map_exec(&first);
    for _ in 0..FULL_SCAN_EVERY {
        told_scan(&mut discovery, &[], 0, &[], &mut prober);
    }
    assert!(prober.attached.is_empty(), "no event, no read before the rescan is due");
    discovery.rescan_due();
    told_scan(&mut discovery, &[], 0, &[], &mut prober);
    assert_eq!(prober.attached, vec![id_of(&first)], "the rescan finds it");
    let stats = discovery.stats();
    assert_eq!((stats.rescans, stats.found_by_rescan), (1, 1), "{stats:?}");

    // Events lost (the kernel's map full): every process read at once, what it finds counted.
    let second = scratch.library("libquiet2.so", &LIBCUDA_LIKE);
    let map2 = map_exec(&second);
    told_scan(&mut discovery, &[], 3, &[], &mut prober);
    assert_eq!(prober.attached, vec![id_of(&first), id_of(&second)]);
    let stats = discovery.stats();
    assert_eq!((stats.rescans, stats.found_by_rescan, stats.events_lost), (2, 2, 3), "{stats:?}");
    drop((map, map2));
}

#[test]
fn a_file_left_for_a_later_scan_is_read_at_the_next_one() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let scratch = Scratch::new("budget");
    let copies: Vec<PathBuf> = (0..PARSES_PER_CONTAINER_PER_SCAN + 2).map(|i| scratch.library(&format!("libjunk{i}.so"), &["compute"])).collect();
    let library = scratch.library("libzz.so", &LIBCUDA_LIKE);
    let mut discovery = Discovery::new(caps(4, 64));
    let mut prober = Recorder::default();
    told_scan(&mut discovery, &[], 0, &[], &mut prober);
    // Mapped last, each lands below the one before: the junk comes first in the maps.
    let maps: Vec<_> = [&library].into_iter().chain(&copies).map(map_exec).collect();
    told_scan(&mut discovery, &[std::process::id()], 0, &[], &mut prober);
    assert!(prober.attached.is_empty(), "this container's budget spent on the other files first");
    told_scan(&mut discovery, &[], 0, &[], &mut prober);
    assert_eq!(prober.attached, vec![id_of(&library)], "the rest read at the next scan, with no new event");
    assert_eq!(discovery.stats().found_by_rescan, 0);
    drop(maps);
}

#[test]
fn processes_named_by_the_kernel_that_are_gone_are_not_kept() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut discovery = Discovery::new(caps(4, 64));
    let mut prober = Recorder::default();
    told_scan(&mut discovery, &[], 0, &[], &mut prober);
    let kept = discovery.seen.len();
    // A storm of short-lived processes, each named by the kernel (an exec, a mapping made
    // executable) and gone (reaped) before the scan reads it.
    let gone: Vec<u32> = (0..20)
        .map(|_| {
            let mut child = std::process::Command::new("true").spawn().expect("spawn true");
            child.wait().expect("reap");
            child.id()
        })
        .collect();
    for _ in 0..3 {
        told_scan(&mut discovery, &gone, 0, &[], &mut prober);
    }
    assert_eq!(reads(&discovery).0, 20 * 3, "each looked for at each scan that named it");
    assert_eq!(discovery.seen.len(), kept, "nothing kept of the gone processes");
    // A live process named by the kernel is still remembered.
    told_scan(&mut discovery, &[std::process::id()], 0, &[], &mut prober);
    assert!(discovery.seen.contains_key(&std::process::id()));
}
