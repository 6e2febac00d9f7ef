//! The repository stands alone: no tracked file may point into the directory beside the
//! checkout that its authors once kept notes in, since users who clone the repository do not
//! have it. What those notes said lives in `docs/design.md` and `docs/security.md`.
//!
//! [`check`] lists the tracked files (`git ls-files` at the workspace root), skips binary
//! ones (a NUL byte in the first 8 KiB, as git decides), and fails naming every file and
//! line that still holds the reference. The needle is built from two parts, so this file
//! does not trip the check it implements.
use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};

/// The reference no tracked file may hold.
pub const NEEDLE: &str = concat!("..", "/shared");

/// One hit: the file (relative to the repository root), the line number (from 1) and the line.
#[derive(Debug, PartialEq, Eq)]
pub struct Hit {
    pub file: PathBuf,
    pub line: usize,
    pub text: String,
}

/// Fails naming every tracked file and line of the repository that holds [`NEEDLE`].
pub fn check() -> Result<()> {
    let root = crate::root();
    let hits = scan(&root, &tracked(&root)?)?;
    if !hits.is_empty() {
        let lines: Vec<String> = hits.iter().map(|hit| format!("  {}:{}: {}", hit.file.display(), hit.line, hit.text.trim())).collect();
        bail!(
            "{} line(s) refer to `{NEEDLE}`, a directory outside the repository that users do not have; \
             point them at docs/design.md or docs/security.md instead:\n{}",
            hits.len(),
            lines.join("\n")
        );
    }
    Ok(())
}

/// The files git tracks under `root`, relative to it.
fn tracked(root: &Path) -> Result<Vec<PathBuf>> {
    let output = Command::new("git")
        .args(["ls-files", "-z"])
        .current_dir(root)
        .output()
        .with_context(|| format!("cannot run `git ls-files` in {}", root.display()))?;
    if !output.status.success() {
        bail!("`git ls-files` failed in {}: {}", root.display(), String::from_utf8_lossy(&output.stderr).trim());
    }
    Ok(output
        .stdout
        .split(|&byte| byte == 0)
        .filter(|name| !name.is_empty())
        .map(|name| PathBuf::from(String::from_utf8_lossy(name).into_owned()))
        .collect())
}

/// The hits in `files` (relative to `root`). A file that is listed but absent (deleted in the
/// work tree, not yet in the index) is skipped; so is a binary one.
pub fn scan(root: &Path, files: &[PathBuf]) -> Result<Vec<Hit>> {
    let mut hits = Vec::new();
    for file in files {
        let path = root.join(file);
        if !path.is_file() {
            continue;
        }
        let bytes = fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
        if is_binary(&bytes) {
            continue;
        }
        hits.extend(scan_text(&String::from_utf8_lossy(&bytes)).into_iter().map(|(line, text)| Hit { file: file.clone(), line, text }));
    }
    Ok(hits)
}

/// The lines of `text` (numbered from 1) that hold [`NEEDLE`].
pub fn scan_text(text: &str) -> Vec<(usize, String)> {
    text.lines()
        .enumerate()
        .filter(|(_, line)| line.contains(NEEDLE))
        .map(|(index, line)| (index + 1, line.to_string()))
        .collect()
}

/// Whether `bytes` look binary: a NUL byte in the first 8000 bytes (git's own test).
fn is_binary(bytes: &[u8]) -> bool {
    bytes.iter().take(8000).any(|&byte| byte == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_every_file_and_line_with_the_reference() {
        let dir = std::env::temp_dir().join(format!("vramguard-standalone-{}", std::process::id()));
        fs::create_dir_all(dir.join("docs")).unwrap();
        fs::write(dir.join("README.md"), format!("# title\nsee `{NEEDLE}/DESIGN.md`\nfine\n")).unwrap();
        fs::write(dir.join("docs/clean.md"), "nothing outside\n").unwrap();
        fs::write(dir.join("lib.rs"), format!("//! one\n//! two\n// rule 1 (`{NEEDLE}/security.md`)\n")).unwrap();
        let mut binary = b"\0\x01".to_vec();
        binary.extend_from_slice(NEEDLE.as_bytes());
        fs::write(dir.join("blob.bin"), binary).unwrap();
        let files: Vec<PathBuf> = ["README.md", "docs/clean.md", "lib.rs", "blob.bin", "gone.md"].iter().map(PathBuf::from).collect();
        let hits = scan(&dir, &files).unwrap();
        fs::remove_dir_all(&dir).unwrap();
        let found: Vec<(String, usize)> = hits.iter().map(|hit| (hit.file.display().to_string(), hit.line)).collect();
        assert_eq!(found, vec![("README.md".to_string(), 2), ("lib.rs".to_string(), 3)]);
        assert!(hits[0].text.contains("DESIGN.md"));
    }

    #[test]
    fn reads_lines_of_text() {
        assert_eq!(scan_text(&format!("a\nb {NEEDLE}\nc")), vec![(2, format!("b {NEEDLE}"))]);
        assert_eq!(scan_text(&format!("{NEEDLE}_notes\n")).len(), 1, "a longer name is a reference too");
        assert!(scan_text("shared/ and ../other\n").is_empty());
    }

    #[test]
    fn the_repository_stands_alone() {
        check().unwrap();
    }
}
