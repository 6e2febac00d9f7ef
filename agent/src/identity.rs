//! Which host process a ledger slot belongs to. A slot records the pid a process has in its
//! own pid namespace, that namespace's inode, and its start time; the host pid is the one
//! whose `/proc/<pid>/ns/pid` is that namespace, whose last `NSpid` entry is that pid, and
//! whose start time matches (so a reused pid is never mistaken for the slot's process). A
//! zombie (every thread exited, not yet reaped) counts as gone: its GPU memory is already
//! released ([`ledger::process::running_start_time_of`]; a leader whose other threads run is
//! not one).
//!
//! [`host_pid`] scans /proc for one slot; [`ProcessTable`] scans it once for many slots (the
//! agent's sweep); [`ProbedProcesses`] keeps the identities of the processes the probes
//! report, read once per process (the reconcile pass).
use std::{collections::HashMap, fs, ops::ControlFlow, os::unix::fs::MetadataExt};

use ledger::{layout::Slot, ProcessIdentity};

/// The host pid of the process a slot describes, if it is still running.
pub fn host_pid(slot: &Slot) -> Option<u32> {
    let process = slot.process();
    let entries = fs::read_dir("/proc").ok()?;
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()))
        .find(|&pid| is_process(pid, &process))
}

/// Whether host process `host_pid` runs (not a zombie) and is the process `process`
/// describes: same start time, pid namespace and pid in that namespace. A slot's host pid is
/// a field its workload can write: this is what the agent checks before trusting it.
pub fn is_process(host_pid: u32, process: &ProcessIdentity) -> bool {
    // The namespace first: the cheapest test, and the one most processes of a scan fail.
    fs::metadata(format!("/proc/{host_pid}/ns/pid")).map(|m| m.ino()).ok() == Some(process.pidns)
        && namespace_pid(host_pid) == Some(process.pid)
        && ledger::process::running_start_time_of(host_pid) == Some(process.start_time)
}

/// The identity of host process `pid` (pid namespace, pid in it, start time), running or a
/// zombie: what an exit event's process was, looked up while it is still in /proc.
pub fn identity_of(pid: u32) -> Option<ProcessIdentity> {
    let pidns = fs::metadata(format!("/proc/{pid}/ns/pid")).ok()?.ino();
    let inner = namespace_pid(pid)?;
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Field 22 (start time) is the 20th after the command name, which ends at the last ')'.
    let start_time = stat[stat.rfind(')')? + 1..].split_whitespace().nth(19)?.parse().ok()?;
    Some(ProcessIdentity { pid: inner, pidns, start_time })
}

/// The inode of the initial pid namespace (`PROC_PID_INIT_INO` in the kernel).
const INITIAL_PIDNS_INODE: u64 = 0xEFFF_FFFC;

/// Whether this process runs in the host's (initial) pid namespace, where every process of
/// every container is visible; elsewhere a slot's process may be alive yet invisible.
pub fn in_initial_pid_namespace() -> bool {
    fs::metadata("/proc/self/ns/pid").map(|m| m.ino()).ok() == Some(INITIAL_PIDNS_INODE)
}

/// Every running process at one instant, by (pid namespace inode, pid in that namespace).
/// A process that starts after [`ProcessTable::scan`] is missing from it: a caller must
/// confirm with [`host_pid`] before treating a slot it does not find as dead.
pub struct ProcessTable {
    /// (pidns, pid in it) -> (host pid, start time).
    processes: HashMap<(u64, u32), (u32, u64)>,
}

impl ProcessTable {
    pub fn scan() -> ProcessTable {
        let mut processes = HashMap::new();
        let Ok(entries) = fs::read_dir("/proc") else { return ProcessTable { processes } };
        for entry in entries.flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
            let Ok(pidns) = fs::metadata(format!("/proc/{pid}/ns/pid")).map(|m| m.ino()) else { continue };
            let (Some(inner), Some(start)) = (namespace_pid(pid), ledger::process::running_start_time_of(pid)) else {
                continue;
            };
            processes.insert((pidns, inner), (pid, start));
        }
        ProcessTable { processes }
    }

    /// The host pid of the running process `slot` describes, as of the scan.
    pub fn find(&self, slot: &Slot) -> Option<u32> {
        let &(pid, start) = self.processes.get(&(slot.pidns, slot.pid))?;
        (start == slot.start_time).then_some(pid)
    }
}

/// The identities of the processes the probes report, each read from /proc once (when the
/// probes first report the process, or report a new process under a reused pid, which they
/// tell by its generation), and the row of each in the probes' latest report: what lets a
/// pass join many slots with their processes at one hash look-up per slot.
#[derive(Default)]
pub struct ProbedProcesses {
    by_pid: foldhash::HashMap<u32, usize>,
    by_identity: foldhash::HashMap<ProcessIdentity, usize>,
    entries: Vec<Probed>,
    free: Vec<usize>,
    /// Counts [`ProbedProcesses::update`]s: an entry is in the latest report when its
    /// `report` equals it.
    report: u64,
}

#[derive(Clone)]
struct Probed {
    pid: u32,
    generation: u64,
    identity: Option<ProcessIdentity>,
    /// Index in the latest report it was in.
    row: usize,
    report: u64,
    /// False while the entry is on the free list.
    in_use: bool,
    /// Ledger files (device, inode) looked for in its maps, and whether they were there.
    maps: Vec<((u64, u64), bool)>,
    /// Given by [`ProbedProcesses::know`]: not a process to look up in /proc.
    known: bool,
}

impl ProbedProcesses {
    /// Takes the probes' latest report: `(pid, generation)` per row. Processes new to it are
    /// looked up with `identify` (normally [`identity_of`]); those no longer reported are
    /// forgotten.
    pub fn update(&mut self, rows: impl Iterator<Item = (u32, u64)>, mut identify: impl FnMut(u32) -> Option<ProcessIdentity>) {
        self.report += 1;
        for (row, (pid, generation)) in rows.enumerate() {
            match self.by_pid.get(&pid).copied() {
                Some(index) if self.entries[index].generation == generation => {
                    let report = self.report;
                    let entry = &mut self.entries[index];
                    entry.row = row;
                    entry.report = report;
                    // An identity that could not be read is tried again (once read, it is kept).
                    if entry.identity.is_none() {
                        if let Some(identity) = identify(pid) {
                            entry.identity = Some(identity);
                            self.by_identity.insert(identity, index);
                        }
                    }
                }
                known => {
                    if let Some(index) = known {
                        self.forget(index);
                    }
                    self.add(Probed { pid, generation, identity: identify(pid), row, report: self.report, in_use: true, maps: Vec::new(), known: false });
                }
            }
        }
        let gone: Vec<usize> = (0..self.entries.len())
            .filter(|&index| {
                let entry = &self.entries[index];
                entry.in_use && entry.report != self.report
            })
            .collect();
        for index in gone {
            self.forget(index);
        }
    }

    /// The start time /proc gave for process `pid` of the latest report, if it could be read.
    pub fn start_time_of(&self, pid: u32) -> Option<u64> {
        let entry = &self.entries[*self.by_pid.get(&pid)?];
        entry.identity.map(|identity| identity.start_time)
    }

    /// The row, in the latest report, of the process with `identity`, and the process's
    /// handle here (for [`ProbedProcesses::maps_ledger`]).
    pub fn row_of(&self, identity: &ProcessIdentity) -> Option<(usize, usize)> {
        let index = *self.by_identity.get(identity)?;
        let entry = &self.entries[index];
        (entry.report == self.report).then_some((entry.row, index))
    }

    /// Whether `process` (a handle from [`ProbedProcesses::row_of`]) maps the ledger file
    /// `file` (device, inode), as
    /// every hooked process maps its ledger: a slot that names a process that does not was
    /// written by someone else (a workload forging another container's process into its
    /// ledger). Read from /proc/<pid>/maps once per process and file.
    pub fn maps_ledger(&mut self, process: usize, file: (u64, u64)) -> bool {
        let Some(entry) = self.entries.get_mut(process).filter(|e| e.in_use) else { return false };
        if entry.known {
            return true;
        }
        if let Some(&(_, maps)) = entry.maps.iter().find(|(f, _)| *f == file) {
            return maps;
        }
        let maps = maps_file(entry.pid, file);
        entry.maps.push((file, maps));
        maps
    }

    /// Records the identity of process (`pid`, `generation`) as if read from /proc (its
    /// mappings too), for benchmarks over processes that do not exist; the next report keeps it.
    #[doc(hidden)]
    pub fn know(&mut self, pid: u32, generation: u64, identity: ProcessIdentity) {
        if let Some(index) = self.by_pid.get(&pid).copied() {
            self.forget(index);
        }
        self.add(Probed { pid, generation, identity: Some(identity), row: 0, report: 0, in_use: true, maps: Vec::new(), known: true });
    }

    fn add(&mut self, entry: Probed) {
        let (pid, identity) = (entry.pid, entry.identity);
        let index = match self.free.pop() {
            Some(index) => {
                self.entries[index] = entry;
                index
            }
            None => {
                self.entries.push(entry);
                self.entries.len() - 1
            }
        };
        self.by_pid.insert(pid, index);
        if let Some(identity) = identity {
            self.by_identity.insert(identity, index);
        }
    }

    fn forget(&mut self, index: usize) {
        let entry = &mut self.entries[index];
        entry.in_use = false;
        entry.maps.clear();
        let (pid, identity) = (entry.pid, entry.identity);
        self.by_pid.remove(&pid);
        if let Some(identity) = identity {
            if self.by_identity.get(&identity) == Some(&index) {
                self.by_identity.remove(&identity);
            }
        }
        self.free.push(index);
    }
}

/// Whether host process `pid` maps the file (device, inode) `file` (`/proc/<pid>/maps` names
/// a mapping's file by `major:minor inode`), read within the bounds of [`crate::procmaps`]:
/// a mapping past them is not seen, so a process whose maps are over them maps no file as far
/// as the agent can tell (it is logged).
pub fn maps_file(pid: u32, (dev, ino): (u64, u64)) -> bool {
    // The kernel's encoding of a device number (linux/kdev_t.h, huge_encode_dev).
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    let (device, inode) = (format!("{major:02x}:{minor:02x}"), ino.to_string());
    let mut found = false;
    // address perms offset device inode [path]
    let read = crate::procmaps::each_line(pid, |line| {
        let mut fields = line.split_whitespace().skip(3);
        found = fields.next() == Some(device.as_str()) && fields.next() == Some(inode.as_str());
        if found { ControlFlow::Break(()) } else { ControlFlow::Continue(()) }
    });
    if let Ok(crate::procmaps::Summary { over: Some(bound), .. }) = read {
        tracing::warn!(pid, dev, ino, %bound, "cannot tell whether a process maps a ledger: it is taken not to");
    }
    found
}

/// The pid of host process `pid` inside its own (innermost) pid namespace.
fn namespace_pid(pid: u32) -> Option<u32> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("NSpid:"))?;
    line.split_whitespace().last()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_this_process_and_not_a_reused_pid() {
        let me = ledger::ProcessIdentity::current().expect("identity");
        let mut slot = Slot {
            state: ledger::layout::SLOT_LIVE,
            pid: me.pid,
            pidns: me.pidns,
            start_time: me.start_time,
            host_pid: 0,
            flags: 0,
            allocs: 0,
            frees: 0,
            rejections: 0,
            devices: [Default::default(); ledger::layout::MAX_DEVICES],
        };
        assert_eq!(host_pid(&slot), Some(std::process::id()));
        assert!(is_process(std::process::id(), &me));
        assert!(!is_process(std::process::id(), &ledger::ProcessIdentity { pidns: me.pidns + 1, ..me }), "another namespace");
        assert!(!is_process(std::process::id(), &ledger::ProcessIdentity { pid: me.pid + 1, ..me }), "another pid in it");
        assert_eq!(ProcessTable::scan().find(&slot), Some(std::process::id()));
        assert_eq!(identity_of(std::process::id()), Some(me));
        slot.start_time += 1;
        assert_eq!(host_pid(&slot), None);
        assert_eq!(ProcessTable::scan().find(&slot), None);
    }

    #[test]
    fn a_mapped_file_is_found_in_the_maps() {
        let dir = std::env::temp_dir().join(format!("vramguard-maps-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("mkdir");
        let (mapped, other) = (dir.join("mapped"), dir.join("other"));
        fs::write(&mapped, [1u8; 4096]).expect("write");
        fs::write(&other, [2u8; 4096]).expect("write");
        let id = |path: &std::path::Path| fs::metadata(path).map(|m| (m.dev(), m.ino())).expect("stat");
        let file = fs::File::open(&mapped).expect("open");
        // SAFETY: a private read-only mapping of a file this test owns and does not change.
        let map = unsafe { memmap2::Mmap::map(&file) }.expect("map");
        assert!(maps_file(std::process::id(), id(&mapped)));
        assert!(!maps_file(std::process::id(), id(&other)));
        drop(map);
        assert!(!maps_file(std::process::id(), id(&mapped)));
        fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn probed_processes_are_identified_once_and_follow_the_reports() {
        let id = |pid: u32, start_time: u64| ledger::ProcessIdentity { pid, pidns: 9, start_time };
        let mut lookups = Vec::new();
        let mut probed = ProbedProcesses::default();
        let mut identify = |pid: u32| {
            lookups.push(pid);
            Some(id(pid, u64::from(pid) * 10))
        };
        probed.update([(1, 100), (2, 200)].into_iter(), &mut identify);
        let row = |probed: &ProbedProcesses, identity| probed.row_of(&identity).map(|(row, _)| row);
        assert_eq!((row(&probed, id(1, 10)), row(&probed, id(2, 20))), (Some(0), Some(1)));
        // Same processes in another order: rows follow, nothing looked up again.
        probed.update([(2, 200), (1, 100)].into_iter(), &mut identify);
        assert_eq!((row(&probed, id(1, 10)), row(&probed, id(2, 20))), (Some(1), Some(0)));
        // Pid 1 reused by a new process (new generation): looked up again; pid 2 gone.
        let mut identify = |pid: u32| {
            lookups.push(pid);
            Some(id(pid, 99))
        };
        probed.update([(1, 101)].into_iter(), &mut identify);
        assert_eq!(row(&probed, id(1, 10)), None, "the old process is not the new one");
        assert_eq!(row(&probed, id(1, 99)), Some(0));
        assert_eq!(row(&probed, id(2, 20)), None);
        assert_eq!(lookups, vec![1, 2, 1]);

        // An identity that could not be read is tried again at the next report.
        let mut probed = ProbedProcesses::default();
        probed.update([(5, 500)].into_iter(), |_| None);
        assert_eq!(row(&probed, id(5, 50)), None);
        probed.update([(5, 500)].into_iter(), |pid| Some(id(pid, 50)));
        assert_eq!(row(&probed, id(5, 50)), Some(0));
    }
}
