//! The test image: an OCI image archive (the layout `ctr images import` reads) holding one
//! layer with Debian's static busybox at `/bin`, built from the cached binary.
//!
//! The layer leaves room for programs from the host: `/lib` is a link to `usr/lib` (as on a
//! merged-/usr Debian) and `/lib64/ld-linux-x86-64.so.2` points at the host loader's real path,
//! so bind-mounting the host's library directory at the same path (read-only) lets a
//! dynamically linked glibc program run. `/usr/lib/vramguard`, `/run/vramguard` and
//! `/etc/ld.so.preload` are left absent: runc creates them as mountpoints for the NRI
//! plugin's mounts. The archive is written in the tar format by hand (directories, regular
//! files, symlinks: all it needs). [`oci_archive`] and [`Tar`] also write the agent's own
//! image (`cargo xtask image`).
use std::path::Path;

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};

/// The busybox applets linked in `/bin`.
const APPLETS: [&str; 25] = [
    "sh", "sleep", "cat", "env", "ls", "echo", "true", "false", "test", "grep", "readlink", "id", "ps", "kill", "mkdir",
    "rm", "wc", "head", "tail", "stat", "touch", "mount", "umount", "sed", "cut",
];

const MEDIA_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";

/// Writes the archive of an image named `name` whose entrypoint is `entrypoint` to `out`.
/// `busybox` is the static busybox; `loader` the host's dynamic loader, resolved
/// (e.g. `/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2`).
pub fn write_archive(out: &Path, name: &str, entrypoint: &[&str], busybox: &Path, loader: &Path) -> Result<()> {
    let busybox = std::fs::read(busybox).with_context(|| format!("cannot read {}", busybox.display()))?;
    let loader = loader.to_str().context("the host loader's path is not UTF-8")?;
    let mut layer = Tar::default();
    for dir in ["bin", "etc", "lib64", "opt", "tmp", "usr", "usr/lib", "var"] {
        layer.dir(dir, if dir == "tmp" { 0o1777 } else { 0o755 })?;
    }
    layer.file("bin/busybox", 0o755, &busybox)?;
    for applet in APPLETS {
        layer.symlink(&format!("bin/{applet}"), "busybox")?;
    }
    layer.symlink("lib", "usr/lib")?;
    layer.symlink("lib64/ld-linux-x86-64.so.2", loader)?;
    let config = serde_json::json!({
        "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
        "Entrypoint": entrypoint,
    });
    std::fs::write(out, oci_archive(name, config, layer.finish())?).with_context(|| format!("cannot write {}", out.display()))
}

/// An OCI image layout, as one tar archive (what `ctr images import` reads), of an amd64
/// Linux image named `name` (the index's `io.containerd.image.name` and
/// `org.opencontainers.image.ref.name`) with the image config's `config` section `config`
/// and the one uncompressed layer `layer` (a tar archive, e.g. a [`Tar`]'s). Nothing in it
/// depends on the time or the machine: the same inputs give the same bytes.
pub fn oci_archive(name: &str, config: serde_json::Value, layer: Vec<u8>) -> Result<Vec<u8>> {
    let layer_digest = sha256(&layer);
    let config = serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": config,
        "rootfs": { "type": "layers", "diff_ids": [layer_digest] },
    })
    .to_string()
    .into_bytes();
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": { "mediaType": "application/vnd.oci.image.config.v1+json", "digest": sha256(&config), "size": config.len() },
        "layers": [{ "mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest, "size": layer.len() }],
    })
    .to_string()
    .into_bytes();
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": MEDIA_MANIFEST,
            "digest": sha256(&manifest),
            "size": manifest.len(),
            "annotations": { "io.containerd.image.name": name, "org.opencontainers.image.ref.name": name },
        }],
    })
    .to_string()
    .into_bytes();

    let mut archive = Tar::default();
    archive.file("oci-layout", 0o644, br#"{"imageLayoutVersion":"1.0.0"}"#)?;
    archive.file("index.json", 0o644, &index)?;
    archive.dir("blobs", 0o755)?;
    archive.dir("blobs/sha256", 0o755)?;
    for blob in [&layer, &config, &manifest] {
        let digest = sha256(blob);
        let hex = digest.trim_start_matches("sha256:");
        archive.file(&format!("blobs/sha256/{hex}"), 0o644, blob)?;
    }
    Ok(archive.finish())
}

/// `sha256:<hex>` of `bytes`.
pub fn sha256(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// A tar archive (ustar headers) built in memory, every entry owned by root, time 0.
#[derive(Default)]
pub struct Tar {
    bytes: Vec<u8>,
}

impl Tar {
    pub fn dir(&mut self, path: &str, mode: u32) -> Result<()> {
        self.header(&format!("{path}/"), mode, 0, b'5', "")
    }

    pub fn file(&mut self, path: &str, mode: u32, contents: &[u8]) -> Result<()> {
        self.header(path, mode, contents.len() as u64, b'0', "")?;
        self.bytes.extend_from_slice(contents);
        self.pad();
        Ok(())
    }

    pub fn symlink(&mut self, path: &str, target: &str) -> Result<()> {
        self.header(path, 0o777, 0, b'2', target)
    }

    fn header(&mut self, path: &str, mode: u32, size: u64, kind: u8, link: &str) -> Result<()> {
        if path.len() > 100 || link.len() > 100 {
            bail!("tar: {path:?} or {link:?} is longer than a plain header holds");
        }
        let mut header = [0u8; 512];
        let mut put = |offset: usize, value: &[u8]| header[offset..offset + value.len()].copy_from_slice(value);
        put(0, path.as_bytes());
        put(100, format!("{mode:07o}\0").as_bytes());
        put(108, b"0000000\0"); // uid
        put(116, b"0000000\0"); // gid
        put(124, format!("{size:011o}\0").as_bytes());
        put(136, b"00000000000\0"); // mtime: reproducible
        put(148, b"        "); // the checksum counts itself as spaces
        put(156, &[kind]);
        put(157, link.as_bytes());
        put(257, b"ustar\0");
        put(263, b"00");
        put(265, b"root");
        put(297, b"root");
        let sum: u32 = header.iter().map(|&b| u32::from(b)).sum();
        header[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
        self.bytes.extend_from_slice(&header);
        Ok(())
    }

    fn pad(&mut self) {
        let rest = self.bytes.len() % 512;
        if rest != 0 {
            self.bytes.resize(self.bytes.len() + 512 - rest, 0);
        }
    }

    /// The archive with its two closing zero blocks.
    pub fn finish(mut self) -> Vec<u8> {
        self.bytes.resize(self.bytes.len() + 1024, 0);
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The archive lists as tar reads it (GNU tar is on every Debian machine).
    #[test]
    fn tar_reads_the_archive() {
        let mut tar = Tar::default();
        tar.dir("d", 0o755).unwrap();
        tar.file("d/f", 0o640, b"hello").unwrap();
        tar.symlink("d/l", "f").unwrap();
        let dir = crate::TempDir::new("tar").unwrap();
        let path = dir.path().join("t.tar");
        std::fs::write(&path, tar.finish()).unwrap();
        let out = std::process::Command::new("tar").arg("-tvf").arg(&path).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let listing = String::from_utf8_lossy(&out.stdout);
        let lines: Vec<&str> = listing.lines().collect();
        assert_eq!(lines.len(), 3, "{listing}");
        assert!(lines[0].starts_with("drwxr-xr-x root/root") && lines[0].ends_with(" d/"), "{listing}");
        assert!(lines[1].starts_with("-rw-r----- root/root") && lines[1].contains(" 5 ") && lines[1].ends_with(" d/f"), "{listing}");
        assert!(lines[2].starts_with("lrwxrwxrwx") && lines[2].ends_with(" d/l -> f"), "{listing}");
    }

    #[test]
    fn digests_are_sha256() {
        assert_eq!(sha256(b""), "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    }
}
