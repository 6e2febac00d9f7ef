//! `cargo xtask image`: the agent's OCI image, built offline and reproducibly, as an OCI
//! archive (`target/vramguard-image.tar`, the layout `ctr images import`, `skopeo copy
//! oci-archive:` and `podman load` read).
//!
//! What is in it ([`layout`]): the release agent at `/usr/local/bin/vramguard` (the
//! entrypoint; in the image `cargo xtask test` builds for the end-to-end tests, the test build
//! of the same sources, [`Agent::Test`]), the hook at `/usr/local/lib/vramguard/libvramguard.so`, the C libraries the
//! agent needs (and those a driver's `libnvidia-ml.so.1` links, which the agent loads) with
//! their loader, and Debian's static busybox as `/bin/sh` with the applets the DaemonSet's
//! initContainer runs (`mkdir`, `cp`, `chmod`, `mv`). Nothing else: no package manager, no
//! shell beyond busybox, no `/etc`.
//!
//! Where each piece comes from:
//! - the libraries: Debian bookworm's `libc6` and `libgcc-s1` packages (the glibc the agent is
//!   built against here is bookworm's), fetched by `cargo xtask setup` into
//!   `target/image-base/` with the private apt state `crate::containerd` uses, versions
//!   recorded in its `VERSIONS` file;
//! - the hook: linked against Debian bullseye's glibc 2.31 (`libc6`, `libc6-dev`, `libgcc-s1`
//!   from bullseye, unpacked as a sysroot in the same cache), so that it loads in workload
//!   images with glibc 2.31 or later, whatever glibc the build machine has. It is built in a
//!   target directory of its own (`target/image-hook`) with `--sysroot` and the sysroot's
//!   library directories (`-L`, ahead of gcc's own, which hold the build machine's glibc)
//!   given to the linker for the hook's own link only (`cargo rustc`), and checked: no
//!   symbol version above `GLIBC_2.31` ([`MAX_GLIBC`]) may be in its dynamic symbol table,
//!   and bullseye's loader (`ld.so --list` on bullseye's libraries) must resolve it;
//! - busybox: the static `busybox-static` of bookworm the e2e tests' image is made of (the
//!   containerd cache).
//!
//! The binaries are copied without their debug sections (`objcopy --strip-debug`); every
//! archive entry has uid 0, time 0 and a fixed mode, entries come in a fixed order, and
//! the JSON documents have sorted keys: the same build gives the same bytes (the digest is
//! printed). `deploy/Dockerfile` builds the same root file system with the same code
//! (`cargo xtask image --rootfs /rootfs` in its build stage, `COPY --from=build /rootfs/ /` on
//! `scratch`), and its final stage is checked against this module's configuration by a test
//! ([`tests::the_dockerfile_builds_this_layout`]).
use std::{
    fs,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{bail, ensure, Context, Result};
use e2e::containerd::image::{oci_archive, sha256, Tar};

use crate::{containerd::Apt, root, run};

/// The image's name, as the DaemonSet names it.
pub const NAME: &str = concat!("ghcr.io/vramguard/vramguard:", env!("CARGO_PKG_VERSION"));
/// The agent, the entrypoint.
pub const AGENT: &str = "/usr/local/bin/vramguard";
/// The hook, where the initContainer copies it from.
pub const HOOK: &str = "/usr/local/lib/vramguard/libvramguard.so";
/// `docker run IMAGE` runs `vramguard run`; the DaemonSet gives its own arguments.
pub const CMD: &[&str] = &["run"];
/// Root: the agent needs uid 0 for its capabilities to apply to every user's files.
pub const USER: &str = "0:0";
pub const PATH_ENV: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// The image's labels (OCI annotations' keys).
pub const LABELS: &[(&str, &str)] = &[
    ("org.opencontainers.image.title", "vramguard"),
    ("org.opencontainers.image.description", "GPU memory quotas for CUDA workloads: the node agent and the hook"),
    ("org.opencontainers.image.version", env!("CARGO_PKG_VERSION")),
    ("org.opencontainers.image.licenses", "Apache-2.0"),
];
/// busybox applets in `/bin`: the initContainer's shell and the commands it runs.
pub const APPLETS: &[&str] = &["sh", "mkdir", "cp", "chmod", "mv"];
/// The newest glibc symbol version the hook may need (bullseye's, Ubuntu 20.04's).
pub const MAX_GLIBC: (u32, u32) = (2, 31);
/// Where the C libraries go (Debian's multiarch directory; `/lib64/ld-linux-x86-64.so.2`
/// links to the loader there, as on Debian).
const LIBDIR: &str = "lib/x86_64-linux-gnu";
/// The libraries of bookworm's `libc6`/`libgcc-s1` the image holds: what the agent links
/// (`libc`, `libm`, `libgcc_s`) and what NVIDIA's `libnvidia-ml.so.1`, loaded by the agent,
/// links besides (`libdl`, `libpthread`, `librt`: stubs in glibc 2.34+).
const LIBRARIES: &[&str] =
    &["ld-linux-x86-64.so.2", "libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1", "libgcc_s.so.1"];

/// A Debian package the image is made from: (name, suite, what for).
const BASE_PACKAGES: &[(&str, &str, &str)] = &[
    ("libc6", "bookworm", "runtime"),
    ("libgcc-s1", "bookworm", "runtime"),
    ("libc6", "bullseye", "sysroot"),
    ("libc6-dev", "bullseye", "sysroot"),
    ("libgcc-s1", "bullseye", "sysroot"),
];

/// One entry of the image's root file system.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// Relative to `/`.
    pub path: String,
    pub mode: u32,
    pub kind: Kind,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Kind {
    Dir,
    /// A file copied from this build-machine path.
    File(PathBuf),
    Symlink(String),
}

/// `target/image-base/`: the unpacked packages ([`BASE_PACKAGES`]).
fn base_dir() -> PathBuf {
    crate::containerd::target().join("image-base")
}

/// The OCI archive `cargo xtask image` writes.
pub fn archive_path() -> PathBuf {
    crate::containerd::target().join("vramguard-image.tar")
}

/// `cargo xtask setup`'s part: fetches [`BASE_PACKAGES`] unless `target/image-base` is complete.
pub fn setup() -> Result<()> {
    let dir = base_dir();
    if let Ok(versions) = fs::read_to_string(dir.join("VERSIONS")) {
        println!("setup: the image's Debian packages in {}: present ({})", dir.display(), crate::containerd::one_line(&versions));
        return Ok(());
    }
    let start = Instant::now();
    let work = crate::containerd::target().join("image-base.fetch");
    let _ = fs::remove_dir_all(&work);
    let result = fetch(&work, &dir);
    let _ = fs::remove_dir_all(&work);
    let versions = result?;
    println!("setup: the image's Debian packages: {} in {:.1?}", crate::containerd::one_line(&versions), start.elapsed());
    Ok(())
}

fn fetch(work: &Path, dir: &Path) -> Result<String> {
    let apt = Apt::new(work, &["bookworm", "bullseye"])?;
    println!("setup: fetching glibc (bookworm, bullseye) for the image from Debian's archive (private apt state in {})", work.display());
    apt.run("update", &[], work).context("cannot read the package lists of Debian's archive (is the network down?)")?;
    let fresh = dir.with_extension("new");
    let _ = fs::remove_dir_all(&fresh);
    let mut versions = String::new();
    for (name, suite, purpose) in BASE_PACKAGES {
        let downloads = work.join("downloads").join(suite);
        fs::create_dir_all(&downloads)?;
        apt.run("download", &[&format!("{name}/{suite}")], &downloads).with_context(|| format!("cannot download {name}/{suite}"))?;
        let deb = crate::containerd::find_deb(&downloads, name)?;
        let into = fresh.join(format!("{suite}-{purpose}"));
        fs::create_dir_all(&into)?;
        run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&into)).with_context(|| format!("cannot unpack {}", deb.display()))?;
        rebase_links(&into, &into)?;
        let version = crate::containerd::output(Command::new("dpkg-deb").args(["--showformat=${Version}", "--show"]).arg(&deb))?;
        versions.push_str(&format!("{name} {} ({suite}, {purpose})\n", version.trim()));
    }
    fs::write(fresh.join("VERSIONS"), &versions)?;
    let _ = fs::remove_dir_all(dir);
    fs::rename(&fresh, dir).with_context(|| format!("cannot move {} to {}", fresh.display(), dir.display()))?;
    Ok(versions)
}

/// Points every absolute symlink under `dir` into `root`, relatively (`/lib64/ld-linux-x86-64.so.2
/// -> /lib/x86_64-linux-gnu/ld-2.31.so` means the sysroot's loader, not the build machine's):
/// relative links stay right when the directory is moved into place, and a second package
/// unpacked into the same root leaves the first one's links as they are.
fn rebase_links(dir: &Path, root: &Path) -> Result<()> {
    for entry in fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))?.flatten() {
        let path = entry.path();
        let kind = entry.file_type()?;
        if kind.is_dir() {
            rebase_links(&path, root)?;
        } else if kind.is_symlink() {
            let to = fs::read_link(&path)?;
            if let Ok(inside) = to.strip_prefix("/") {
                let depth = path.parent().and_then(|parent| parent.strip_prefix(root).ok()).map_or(0, |within| within.components().count());
                let relative: PathBuf = std::iter::repeat_n(Path::new(".."), depth).collect::<PathBuf>().join(inside);
                fs::remove_file(&path)?;
                std::os::unix::fs::symlink(&relative, &path).with_context(|| format!("cannot relink {}", path.display()))?;
            }
        }
    }
    Ok(())
}

/// Which agent binary goes into the image.
pub enum Agent {
    /// The release build (`cargo xtask image`: what ships).
    Release,
    /// The test build `cargo xtask test` made already (`target/debug/vramguard`, the same
    /// sources; its debug sections stripped as the release's are): the image the end-to-end
    /// tests run, without a second, optimised build of the whole agent in CI.
    Test,
}

/// `cargo xtask image [--rootfs DIR]` ([`Agent::Release`]), and `cargo xtask test`'s image
/// ([`Agent::Test`]).
pub fn image(rootfs: Option<PathBuf>, agent: Agent) -> Result<()> {
    let base = base_dir();
    ensure!(base.join("VERSIONS").is_file(), "no {}: run `cargo xtask setup` (it fetches the image's glibc once)", base.display());
    let dockerfile = dockerfile();
    check_dockerfile(&fs::read_to_string(&dockerfile).with_context(|| format!("cannot read {}", dockerfile.display()))?)?;
    crate::build_ebpf()?;
    let start = Instant::now();
    let profile = match agent {
        Agent::Release => {
            run(crate::cargo().args(["build", "--release", "-p", "agent"])).context("building the release agent")?;
            println!("image: release agent built in {:.1?}", start.elapsed());
            "release"
        }
        Agent::Test => {
            // Not rebuilt here: a `cargo build -p agent` resolves features for the agent alone,
            // unlike the workspace's build, and would compile it and its dependencies again.
            let built = crate::containerd::target().join("debug/vramguard");
            ensure!(built.is_file(), "{} is not built: `cargo xtask test` builds it before the image", built.display());
            "debug"
        }
    };
    let start = Instant::now();
    let hook = build_hook(&base.join("bullseye-sysroot"))?;
    println!("image: hook built against glibc {}.{} in {:.1?}", MAX_GLIBC.0, MAX_GLIBC.1, start.elapsed());
    let stripped = crate::containerd::target().join("image-stripped");
    fs::create_dir_all(&stripped)?;
    let agent = strip(&crate::containerd::target().join(profile).join("vramguard"), &stripped.join("vramguard"))?;
    let hook = strip(&hook, &stripped.join("libvramguard.so"))?;
    let busybox = e2e::containerd::Cache::open(&e2e::containerd::Cache::dir_in(&crate::containerd::target()))?.bin("busybox");
    let entries = layout(&agent, &hook, &busybox, &base.join("bookworm-runtime"))?;
    if let Some(dir) = rootfs {
        write_rootfs(&entries, &dir)?;
        println!("image: root file system written to {}", dir.display());
        return Ok(());
    }
    let archive = oci_archive(NAME, config(), layer(&entries)?)?;
    let out = archive_path();
    fs::write(&out, &archive).with_context(|| format!("cannot write {}", out.display()))?;
    println!("image: {NAME} written to {} ({} bytes, {})", out.display(), archive.len(), sha256(&archive));
    Ok(())
}

/// Links the hook against the glibc of `sysroot`; fails if it needs a newer glibc than [`MAX_GLIBC`].
fn build_hook(sysroot: &Path) -> Result<PathBuf> {
    let target = crate::containerd::target().join("image-hook");
    run(crate::cargo()
        .args(["rustc", "--release", "-p", "hook", "--lib", "--target-dir"])
        .arg(&target)
        .arg("--")
        .arg(format!("-Clink-arg=--sysroot={}", sysroot.display()))
        // gcc searches its own library directory (the build machine's glibc) before the
        // sysroot's: the sysroot's directories go first.
        .arg(format!("-Clink-arg=-L{}", sysroot.join("usr/lib/x86_64-linux-gnu").display()))
        .arg(format!("-Clink-arg=-L{}", sysroot.join("lib/x86_64-linux-gnu").display())))
    .context("building the hook against bullseye's glibc")?;
    let hook = target.join("release/libvramguard.so");
    let newest = newest_glibc(&hook)?;
    ensure!(newest <= MAX_GLIBC, "{} needs GLIBC_{}.{}, newer than {}.{}", hook.display(), newest.0, newest.1, MAX_GLIBC.0, MAX_GLIBC.1);
    // And bullseye's own loader resolves it against bullseye's libraries (it names every
    // version it cannot find: `version 'GLIBC_2.34' not found`).
    let libs = sysroot.join("lib/x86_64-linux-gnu");
    let out = Command::new(libs.join("ld-linux-x86-64.so.2"))
        .arg("--library-path")
        .arg(&libs)
        .arg("--list")
        .arg(&hook)
        .output()
        .context("cannot run bullseye's loader")?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(out.status.success() && !stderr.contains("not found"), "glibc 2.31's loader cannot load {}: {stderr}", hook.display());
    Ok(hook)
}

/// The newest `GLIBC_x.y` version among the dynamic symbols of `file` (`objdump -T`).
pub fn newest_glibc(file: &Path) -> Result<(u32, u32)> {
    let out = crate::containerd::output(Command::new("objdump").arg("-T").arg(file))?;
    let mut newest = (0, 0);
    for word in out.split(|c: char| c.is_whitespace() || c == '(' || c == ')') {
        let Some(version) = word.strip_prefix("GLIBC_") else { continue };
        let mut parts = version.split('.').map(|p| p.parse::<u32>());
        if let (Some(Ok(major)), Some(Ok(minor))) = (parts.next(), parts.next()) {
            newest = newest.max((major, minor));
        }
    }
    ensure!(newest > (0, 0), "no GLIBC_ symbol versions in {} (is it a glibc program?)", file.display());
    Ok(newest)
}

fn strip(from: &Path, to: &Path) -> Result<PathBuf> {
    run(Command::new("objcopy").arg("--strip-debug").arg(from).arg(to))?;
    Ok(to.to_path_buf())
}

/// The image's root file system, parents before children.
pub fn layout(agent: &Path, hook: &Path, busybox: &Path, runtime: &Path) -> Result<Vec<Entry>> {
    let dir = |path: &str| Entry { path: path.into(), mode: 0o755, kind: Kind::Dir };
    let file = |path: &str, from: PathBuf| Entry { path: path.into(), mode: 0o755, kind: Kind::File(from) };
    let link = |path: &str, to: &str| Entry { path: path.into(), mode: 0o777, kind: Kind::Symlink(to.into()) };
    let mut entries = vec![dir("bin"), file("bin/busybox", busybox.into())];
    entries.extend(APPLETS.iter().map(|applet| link(&format!("bin/{applet}"), "busybox")));
    entries.extend([dir("lib"), dir(LIBDIR)]);
    for library in LIBRARIES {
        let from = [LIBDIR, &format!("usr/{LIBDIR}")].iter().map(|d| runtime.join(d).join(library)).find(|p| p.exists());
        let from = from.with_context(|| format!("{library} is not in {} (Debian's package layout changed?)", runtime.display()))?;
        // The packages install `libc.so.6` etc. as the files themselves; resolve any link.
        let from = fs::canonicalize(&from).with_context(|| format!("cannot resolve {}", from.display()))?;
        entries.push(file(&format!("{LIBDIR}/{library}"), from));
    }
    entries.extend([dir("lib64"), link("lib64/ld-linux-x86-64.so.2", &format!("/{LIBDIR}/ld-linux-x86-64.so.2"))]);
    let (agent_dir, hook_dir) = (AGENT.trim_start_matches('/'), HOOK.trim_start_matches('/'));
    for path in ["usr", "usr/local", "usr/local/bin", "usr/local/lib", "usr/local/lib/vramguard"] {
        entries.push(dir(path));
    }
    entries.extend([file(agent_dir, agent.into()), file(hook_dir, hook.into())]);
    Ok(entries)
}

/// The image config's `config` section.
pub fn config() -> serde_json::Value {
    let labels: serde_json::Map<String, serde_json::Value> = LABELS.iter().map(|(k, v)| (k.to_string(), (*v).into())).collect();
    serde_json::json!({
        "Entrypoint": [AGENT],
        "Cmd": CMD,
        "User": USER,
        "Env": [PATH_ENV],
        "Labels": labels,
    })
}

/// The layer: a tar archive of `entries`.
fn layer(entries: &[Entry]) -> Result<Vec<u8>> {
    let mut tar = Tar::default();
    for entry in entries {
        match &entry.kind {
            Kind::Dir => tar.dir(&entry.path, entry.mode)?,
            Kind::File(from) => tar.file(&entry.path, entry.mode, &fs::read(from).with_context(|| format!("cannot read {}", from.display()))?)?,
            Kind::Symlink(to) => tar.symlink(&entry.path, to)?,
        }
    }
    Ok(tar.finish())
}

/// Writes `entries` under `dir` (the Dockerfile copies that directory onto `scratch`).
fn write_rootfs(entries: &[Entry], dir: &Path) -> Result<()> {
    fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    for entry in entries {
        let path = dir.join(&entry.path);
        match &entry.kind {
            Kind::Dir => fs::create_dir_all(&path)?,
            Kind::File(from) => {
                fs::copy(from, &path).with_context(|| format!("cannot copy {} to {}", from.display(), path.display()))?;
            }
            Kind::Symlink(to) => {
                let _ = fs::remove_file(&path);
                std::os::unix::fs::symlink(to, &path).with_context(|| format!("cannot link {}", path.display()))?;
                continue;
            }
        }
        fs::set_permissions(&path, fs::Permissions::from_mode(entry.mode))?;
    }
    Ok(())
}

/// The Dockerfile's final stage as this module builds the image (comments aside).
pub fn dockerfile_final_stage() -> Vec<String> {
    let json = |items: &[&str]| serde_json::to_string(items).unwrap_or_default();
    let mut lines = vec!["FROM scratch".to_string(), "COPY --from=build /rootfs/ /".into(), format!("ENV {PATH_ENV}"), format!("USER {USER}")];
    lines.extend(LABELS.iter().map(|(k, v)| format!("LABEL {k}=\"{v}\"")));
    lines.push(format!("ENTRYPOINT {}", json(&[AGENT])));
    lines.push(format!("CMD {}", json(CMD)));
    lines
}

/// The check `deploy/Dockerfile` must pass: its final stage is [`dockerfile_final_stage`] and
/// its build stage writes the root file system with `cargo xtask image --rootfs /rootfs`.
pub fn check_dockerfile(text: &str) -> Result<()> {
    let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).collect();
    let last_from = lines.iter().rposition(|l| l.starts_with("FROM ")).context("no FROM in the Dockerfile")?;
    let stage: Vec<String> = lines[last_from..].iter().map(|l| l.to_string()).collect();
    if stage != dockerfile_final_stage() {
        bail!("deploy/Dockerfile's final stage is\n{}\nbut `cargo xtask image` builds\n{}", stage.join("\n"), dockerfile_final_stage().join("\n"));
    }
    let build = lines[..last_from].join("\n");
    ensure!(build.contains("cargo xtask image --rootfs /rootfs"), "deploy/Dockerfile's build stage does not run `cargo xtask image --rootfs /rootfs`");
    Ok(())
}

/// The repository's Dockerfile.
pub fn dockerfile() -> PathBuf {
    root().join("deploy/Dockerfile")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A package's absolute links point into the sysroot after unpacking, survive its move
    /// into place, and stay right when a second package is unpacked into the same root (the
    /// first `cargo xtask setup` on a fresh clone failed to link the hook without this).
    #[test]
    fn unpacked_links_point_into_the_sysroot_wherever_it_moves() {
        let scratch = std::env::temp_dir().join(format!("vramguard-relink-{}", std::process::id()));
        let root = scratch.join("fresh");
        fs::create_dir_all(root.join("lib/x86_64-linux-gnu")).unwrap();
        fs::create_dir_all(root.join("lib64")).unwrap();
        fs::write(root.join("lib/x86_64-linux-gnu/ld-2.31.so"), b"loader").unwrap();
        std::os::unix::fs::symlink("/lib/x86_64-linux-gnu/ld-2.31.so", root.join("lib64/ld-linux-x86-64.so.2")).unwrap();
        rebase_links(&root, &root).unwrap();
        rebase_links(&root, &root).unwrap(); // a second package unpacked into the same root
        let moved = scratch.join("moved");
        fs::rename(&root, &moved).unwrap();
        assert_eq!(fs::read(moved.join("lib64/ld-linux-x86-64.so.2")).unwrap(), b"loader");
        assert_eq!(fs::read_link(moved.join("lib64/ld-linux-x86-64.so.2")).unwrap(), Path::new("../lib/x86_64-linux-gnu/ld-2.31.so"));
        fs::remove_dir_all(&scratch).unwrap();
    }

    /// `deploy/Dockerfile` and `cargo xtask image` cannot drift: the Dockerfile's build stage
    /// runs this module to write the root file system, and its final stage's configuration
    /// (entrypoint, command, user, environment, labels) is this module's.
    #[test]
    fn the_dockerfile_builds_this_layout() {
        let text = fs::read_to_string(dockerfile()).unwrap();
        check_dockerfile(&text).unwrap();
        // A negative control: a changed entrypoint is caught.
        let changed = text.replace("ENTRYPOINT [\"/usr/local/bin/vramguard\"]", "ENTRYPOINT [\"/bin/vramguard\"]");
        assert_ne!(changed, text);
        assert!(check_dockerfile(&changed).is_err());
    }

    #[test]
    fn reads_glibc_versions_of_a_library() {
        // Any glibc program of this machine has GLIBC_ versions.
        let newest = newest_glibc(Path::new("/bin/true")).unwrap();
        assert!(newest >= (2, 2), "{newest:?}");
    }
}
