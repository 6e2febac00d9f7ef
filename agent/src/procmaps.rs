//! Reading a process's `/proc/<pid>/maps`, line by line, within fixed bounds: the one reader
//! of maps files in the agent (discovery looks for libcuda files in them, reconciliation for
//! a ledger file).
//!
//! A maps file is as large as its process makes it: one file mapped 65,000 times under a
//! 3.8 KB path makes 250 MB of text. So it is never read whole: it is streamed through a
//! fixed buffer, one line at a time, a line longer than [`MAX_LINE_BYTES`] (no kernel line
//! is: a path is at most `PATH_MAX`) is skipped, and the reading stops after [`MAX_BYTES`]
//! bytes or [`MAX_LINES`] lines: the caller gets what was read and learns that the process is
//! over the bound ([`Summary::over`]), to say so. The agent's memory for one maps file is the
//! buffer and one line, whatever the process does.
use std::{
    fmt,
    fs::File,
    io::{self, BufRead, BufReader, Read},
    ops::ControlFlow,
};

/// The most bytes of one process's maps read (a process with libcuda loaded has a few hundred
/// kilobytes; one with every one of the default `vm.max_map_count` of 65,530 mappings named by
/// a 250-byte path has 20 MiB).
pub const MAX_BYTES: u64 = 16 << 20;
/// The most lines of one process's maps read: the kernel's default `vm.max_map_count`, about.
pub const MAX_LINES: usize = 65_536;
/// The longest line read: the fields (at most 100 bytes), a `PATH_MAX` path and ` (deleted)`.
pub const MAX_LINE_BYTES: usize = 4096 + 256;
/// The read buffer.
const BUFFER: usize = 64 << 10;

/// Which bound a maps file went over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bound {
    Bytes,
    Lines,
}

impl fmt::Display for Bound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Bound::Bytes => write!(f, "its maps are over the agent's bound of {MAX_BYTES} bytes"),
            Bound::Lines => write!(f, "its maps are over the agent's bound of {MAX_LINES} lines"),
        }
    }
}

/// What one reading came to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    /// Lines handed to the caller.
    pub lines: usize,
    /// Bytes read, skipped lines included.
    pub bytes: u64,
    /// Lines longer than [`MAX_LINE_BYTES`], skipped.
    pub long_lines: usize,
    /// The bound the file went over (the rest was not read).
    pub over: Option<Bound>,
}

/// Hands each line of `/proc/<pid>/maps` (without its newline; bytes that are not UTF-8, as a
/// path may have, replaced) to `each` until it breaks or a bound is reached.
///
/// A process whose main thread exited alone while its other threads run has an empty
/// `/proc/<pid>/maps`: the kernel lets go of a thread's address space when the thread exits,
/// and the leader stays, a zombie, until the last thread does. Then the maps of its other
/// threads (`/proc/<pid>/task/<tid>/maps`: every thread shares the one address space) are
/// read, the first that is not empty (one exiting shows none), [`THREADS_TRIED`] at most.
pub fn each_line(pid: u32, mut each: impl FnMut(&str) -> ControlFlow<()>) -> io::Result<Summary> {
    let summary = each_line_of(File::open(format!("/proc/{pid}/maps"))?, &mut each)?;
    if summary.bytes > 0 || !ledger::process::has_other_threads(pid) {
        return Ok(summary);
    }
    for tid in ledger::process::other_threads(pid, THREADS_TRIED) {
        let Ok(file) = File::open(format!("/proc/{pid}/task/{tid}/maps")) else { continue };
        let summary = each_line_of(file, &mut each)?;
        if summary.bytes > 0 {
            return Ok(summary);
        }
    }
    Ok(summary)
}

/// Threads of a process whose main thread exited alone tried for its maps.
pub const THREADS_TRIED: usize = 8;

/// [`each_line`] over any reader.
pub fn each_line_of(source: impl Read, mut each: impl FnMut(&str) -> ControlFlow<()>) -> io::Result<Summary> {
    let mut reader = BufReader::with_capacity(BUFFER, source);
    let mut line = Vec::with_capacity(MAX_LINE_BYTES + 1);
    let mut summary = Summary::default();
    loop {
        let left = MAX_BYTES - summary.bytes;
        if left == 0 || summary.lines == MAX_LINES {
            if !reader.fill_buf()?.is_empty() {
                summary.over = Some(if left == 0 { Bound::Bytes } else { Bound::Lines });
            }
            return Ok(summary);
        }
        line.clear();
        let limit = left.min(MAX_LINE_BYTES as u64 + 1);
        let read = (&mut reader).take(limit).read_until(b'\n', &mut line)?;
        if read == 0 {
            return Ok(summary);
        }
        summary.bytes += read as u64;
        if line.last() == Some(&b'\n') {
            line.pop();
        } else if read as u64 == limit && summary.bytes < MAX_BYTES {
            // A line over MAX_LINE_BYTES: skipped up to its newline (or the byte bound).
            summary.long_lines += 1;
            skip_line(&mut reader, &mut summary)?;
            continue;
        } else if read as u64 == limit {
            // The byte bound fell inside this line: it is not handed over.
            continue;
        }
        // else: the last line, without a newline.
        summary.lines += 1;
        if each(&String::from_utf8_lossy(&line)).is_break() {
            return Ok(summary);
        }
    }
}

/// Consumes the rest of a line without keeping it, counting its bytes, up to [`MAX_BYTES`].
fn skip_line(reader: &mut impl BufRead, summary: &mut Summary) -> io::Result<()> {
    loop {
        let buffer = reader.fill_buf()?;
        if buffer.is_empty() {
            return Ok(());
        }
        let left = (MAX_BYTES - summary.bytes) as usize;
        let (taken, done) = match buffer.iter().position(|&b| b == b'\n') {
            Some(newline) if newline < left => (newline + 1, true),
            _ if buffer.len() >= left => (left, true),
            _ => (buffer.len(), false),
        };
        reader.consume(taken);
        summary.bytes += taken as u64;
        if done {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines_of(text: &[u8]) -> (Vec<String>, Summary) {
        let mut lines = Vec::new();
        let summary = each_line_of(text, |line| {
            lines.push(line.to_string());
            ControlFlow::Continue(())
        })
        .expect("read");
        (lines, summary)
    }

    #[test]
    fn hands_over_each_line_and_skips_overlong_ones() {
        let long = format!("1-2 r-xp 0 fd:01 7 /{}\n", "x".repeat(MAX_LINE_BYTES));
        let text = format!("a\nb\n{long}c\nlast");
        let (lines, summary) = lines_of(text.as_bytes());
        assert_eq!(lines, ["a", "b", "c", "last"]);
        assert_eq!(summary, Summary { lines: 4, bytes: text.len() as u64, long_lines: 1, over: None });
        // A line of exactly the cap is kept.
        let exact = format!("{}\n", "y".repeat(MAX_LINE_BYTES));
        assert_eq!(lines_of(exact.as_bytes()).0.len(), 1);
        // Not UTF-8: replaced, not refused.
        assert_eq!(lines_of(b"1-2 r-xp 0 fd:01 7 /\xff\n").0, ["1-2 r-xp 0 fd:01 7 /\u{fffd}"]);
    }

    #[test]
    fn stops_at_the_line_and_byte_bounds() {
        let text = "l\n".repeat(MAX_LINES + 5);
        let (lines, summary) = lines_of(text.as_bytes());
        assert_eq!((lines.len(), summary.over), (MAX_LINES, Some(Bound::Lines)));
        let text = "l\n".repeat(MAX_LINES);
        assert_eq!(lines_of(text.as_bytes()).1.over, None, "exactly at the bound");

        // 3.9 KB lines (the attack's): the byte bound comes first.
        let line = format!("{}\n", "p".repeat(3900));
        let count = (MAX_BYTES as usize / line.len()) + 10;
        let mut handed = 0;
        let summary = each_line_of(line.repeat(count).as_bytes(), |_| {
            handed += 1;
            ControlFlow::Continue(())
        })
        .expect("read");
        assert_eq!(summary.over, Some(Bound::Bytes));
        assert_eq!(summary.bytes, MAX_BYTES);
        assert_eq!(handed, MAX_BYTES as usize / line.len(), "whole lines only");
        assert!(Bound::Bytes.to_string().contains("over the agent's bound"));

        // A caller that has what it wanted stops the reading.
        let mut seen = 0;
        let summary = each_line_of(&b"a\nb\nc\n"[..], |_| {
            seen += 1;
            ControlFlow::Break(())
        })
        .expect("read");
        assert_eq!((seen, summary.lines, summary.over), (1, 1, None));
    }

    #[test]
    fn reads_this_process() {
        let mut mapped = false;
        let summary = each_line(std::process::id(), |line| {
            mapped |= line.ends_with("[stack]");
            ControlFlow::Continue(())
        })
        .expect("our own maps");
        assert!(mapped && summary.over.is_none(), "{summary:?}");
    }
}
