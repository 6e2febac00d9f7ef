//! The candidates in a process's `/proc/<pid>/maps`: its file-backed executable mappings,
//! each named by its address range (for `/proc/<pid>/map_files/<start>-<end>`) and by the
//! device and inode the kernel reports for it. The path in the line is the workload's to
//! choose and is used for log lines only. The file is streamed within the bounds of
//! [`crate::procmaps`], never read whole.
use std::{collections::HashSet, io, ops::ControlFlow};

use crate::procmaps::{self, Summary};

/// One file-backed executable mapping.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapping<'a> {
    pub start: u64,
    pub end: u64,
    /// `makedev(major, minor)` of the line's device, as `st_dev` encodes it.
    pub dev: u64,
    pub ino: u64,
    /// As the kernel prints it (`/path`, or `/path (deleted)`).
    pub path: &'a str,
}

impl Mapping<'_> {
    /// The name of the mapping's entry in `/proc/<pid>/map_files/`.
    pub fn map_files_name(&self) -> String {
        format!("{:x}-{:x}", self.start, self.end)
    }
}

/// Hands each file-backed executable mapping of a `/proc/<pid>/maps` (`source`) to `each`,
/// once per file (device and inode), in order of appearance, within the bounds of
/// [`procmaps`] (the summary says whether the file went over them).
pub fn executable_files(source: impl io::Read, mut each: impl FnMut(&Mapping<'_>)) -> io::Result<Summary> {
    let mut seen = HashSet::new();
    procmaps::each_line_of(source, |line| {
        if let Some(mapping) = parse_line(line).filter(|m| seen.insert((m.dev, m.ino))) {
            each(&mapping);
        }
        ControlFlow::Continue(())
    })
}

/// `start-end perms offset major:minor inode [path]`; `None` unless it is executable and
/// backed by a file (inode not 0, a path starting with `/`).
fn parse_line(line: &str) -> Option<Mapping<'_>> {
    let mut fields = line.splitn(6, ' ');
    let (range, perms, _offset, device, inode) =
        (fields.next()?, fields.next()?, fields.next()?, fields.next()?, fields.next()?);
    let path = fields.next().unwrap_or("").trim_start();
    if perms.as_bytes().get(2) != Some(&b'x') || !path.starts_with('/') {
        return None;
    }
    let ino: u64 = inode.parse().ok().filter(|ino| *ino != 0)?;
    let (start, end) = range.split_once('-')?;
    let (major, minor) = device.split_once(':')?;
    let dev = libc::makedev(u32::from_str_radix(major, 16).ok()?, u32::from_str_radix(minor, 16).ok()?);
    Some(Mapping {
        start: u64::from_str_radix(start, 16).ok()?,
        end: u64::from_str_radix(end, 16).ok()?,
        dev,
        ino,
        path,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_file_backed_executable_mappings_once_per_file() {
        let maps = "\
7f0000000000-7f0000001000 r--p 00000000 fd:01 123 /usr/lib/x86_64-linux-gnu/libcuda.so.580.159
7f0000001000-7f0000002000 r-xp 00001000 fd:01 123 /usr/lib/x86_64-linux-gnu/libcuda.so.580.159
7f0000002000-7f0000002800 r-xp 00002000 fd:01 123 /usr/lib/x86_64-linux-gnu/libcuda.so.580.159
00400000-00401000 r-xp 00000000 fd:01 124 /opt/my dir/libnotcuda.so
7f0000005000-7f0000006000 rw-p 00000000 fd:01 125 /usr/lib/libdata.so
7f0000007000-7f0000008000 rwxp 00000000 00:00 0 
7ffd00000000-7ffd00001000 r-xp 00000000 00:00 0                          [vdso]
7f0000009000-7f000000a000 r-xp 00000000 00:1a 126 /memfd:jit (deleted)
";
        let mut found = Vec::new();
        let summary = executable_files(maps.as_bytes(), |m| found.push(Mapping { path: m.path.to_string().leak(), ..*m })).expect("read");
        assert_eq!((summary.lines, summary.over), (8, None));
        assert_eq!(found.len(), 3, "{found:?}");
        assert_eq!(found[0].map_files_name(), "7f0000001000-7f0000002000");
        assert_eq!((found[0].dev, found[0].ino), (libc::makedev(0xfd, 1), 123));
        assert_eq!(found[1].path, "/opt/my dir/libnotcuda.so");
        assert_eq!(found[1].map_files_name(), "400000-401000", "map_files names are not zero-padded");
        assert_eq!(found[2].path, "/memfd:jit (deleted)");
        assert_eq!(found[2].dev, libc::makedev(0, 0x1a));
    }

    #[test]
    fn ignores_malformed_lines() {
        for line in ["", "garbage", "zz-1 r-xp 0 fd:01 1 /x", "1-2 r-xp 0 fd01 1 /x", "1-2 r-xp 0 fd:01 x /x", "1-2 r-x"] {
            assert_eq!(parse_line(line), None, "{line:?}");
        }
    }
}
