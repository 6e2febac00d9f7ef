//! `cargo xtask setup`: the eBPF toolchain, installed only where missing (docs/design.md,
//! "Platform facts"); also the manifests' validator ([`crate::manifests`]), the real CUDA clients
//! ([`crate::clients`]), the containerd the end-to-end tests run ([`crate::containerd`]) and
//! the Prometheus the monitoring tests run ([`crate::prometheus`]).
//!
//! The eBPF programs build with the nightly toolchain (`-Z build-std=core` needs its
//! `rust-src`) and link with `bpf-linker`, which must use the same LLVM as that nightly
//! rustc. No LLVM can be downloaded here, so bpf-linker is built against the LLVM shared
//! library inside the nightly toolchain, through a small prefix directory of symlinks.
use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{bail, Context, Result};

use crate::run;

/// The toolchain the eBPF crate builds with (ebpf/rust-toolchain.toml says the same).
pub const NIGHTLY: &str = "nightly";
/// bpf-linker releases that work with aya 0.14.
const BPF_LINKER_VERSION: &str = "^0.13";

pub fn setup() -> Result<()> {
    fetch()?;
    ebpf_tools()
}

/// What the tests and the image need beside the build, each fetched where missing: the
/// manifests' validator and the CUDA clients (Python), containerd, Prometheus, the image's
/// glibc. Nothing here is needed to compile, so `cargo xtask test` fetches while it builds.
pub fn fetch() -> Result<()> {
    crate::manifests::setup()?;
    crate::clients::setup()?;
    crate::containerd::setup()?;
    crate::prometheus::setup()?;
    crate::image::setup()
}

/// The eBPF toolchain's pieces (rust-src for the nightly toolchain, bpf-linker), installed
/// where missing.
pub fn ebpf_tools() -> Result<()> {
    let sysroot = nightly_sysroot()?;
    if sysroot.join("lib/rustlib/src/rust/library/core").is_dir() {
        println!("setup: rust-src for {NIGHTLY}: present");
    } else {
        println!("setup: installing rust-src for {NIGHTLY}");
        run(Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", NIGHTLY]))?;
    }
    if bpf_linker_works() {
        println!("setup: bpf-linker: present");
        return Ok(());
    }
    install_bpf_linker(&sysroot)?;
    if !bpf_linker_works() {
        bail!("bpf-linker was installed but does not run: check `bpf-linker --version`");
    }
    Ok(())
}

/// Fails with advice when `build-ebpf` cannot work yet.
pub fn require_ebpf_tools() -> Result<()> {
    let sysroot = nightly_sysroot()?;
    if !sysroot.join("lib/rustlib/src/rust/library/core").is_dir() || !bpf_linker_works() {
        bail!("the eBPF toolchain is incomplete (rust-src for {NIGHTLY}, bpf-linker): run `cargo xtask setup`");
    }
    Ok(())
}

fn nightly_sysroot() -> Result<PathBuf> {
    let output = Command::new("rustup")
        .args(["run", NIGHTLY, "rustc", "--print", "sysroot"])
        .env_remove("RUSTC")
        .env_remove("RUSTUP_TOOLCHAIN")
        .stderr(Stdio::inherit())
        .output()
        .context("cannot run rustup: the eBPF build needs rustup with a nightly toolchain")?;
    if !output.status.success() {
        bail!(
            "no {NIGHTLY} toolchain: the eBPF programs need one (`rustup toolchain install {NIGHTLY}` \
             where the network allows it)"
        );
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&output.stdout).trim()))
}

fn bpf_linker_works() -> bool {
    Command::new("bpf-linker")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// Builds bpf-linker against the nightly toolchain's `libLLVM.so.<major>...`.
fn install_bpf_linker(sysroot: &Path) -> Result<()> {
    let (library, major) = nightly_llvm(&sysroot.join("lib"))?;
    let home = std::env::var_os("HOME").context("HOME is not set")?;
    // Outside the repository: the installed bpf-linker keeps this directory as its runpath.
    let prefix = PathBuf::from(home).join(".cache/vramguard-llvm");
    let lib = prefix.join("lib");
    fs::create_dir_all(&lib).with_context(|| format!("cannot create {}", lib.display()))?;
    let soname = library.file_name().context("LLVM library path has no file name")?;
    for name in [Path::new("libLLVM.so"), Path::new(soname)] {
        let link = lib.join(name);
        let _ = fs::remove_file(&link);
        std::os::unix::fs::symlink(&library, &link)
            .with_context(|| format!("cannot link {} to {}", link.display(), library.display()))?;
    }
    println!("setup: building bpf-linker {BPF_LINKER_VERSION} against LLVM {major} ({})", library.display());
    run(Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
        .args(["install", "bpf-linker", "--force", "--version", BPF_LINKER_VERSION, "--no-default-features"])
        .args(["--features", &format!("llvm-{major}")])
        .env("LLVM_PREFIX", &prefix))
    .context("building bpf-linker")
}

/// The LLVM shared library shipped in the toolchain's lib/ and its major version.
fn nightly_llvm(lib: &Path) -> Result<(PathBuf, u32)> {
    let entries = fs::read_dir(lib).with_context(|| format!("cannot list {}", lib.display()))?;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        // e.g. libLLVM.so.22.1-rust-1.97.0-nightly
        if let Some(version) = name.strip_prefix("libLLVM.so.") {
            if let Some(major) = version.split('.').next().and_then(|m| m.parse().ok()) {
                return Ok((entry.path(), major));
            }
        }
    }
    bail!("no libLLVM.so.<version> in {}: this nightly toolchain cannot host bpf-linker", lib.display())
}
