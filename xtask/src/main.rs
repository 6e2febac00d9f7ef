//! Project automation, run as `cargo xtask <command>`:
//!
//! - `setup`: install what building needs and is missing (rust-src for the nightly toolchain,
//!   `bpf-linker` built against the nightly toolchain's own LLVM, `kubernetes-validate` and
//!   the real CUDA clients the e2e tests run (cuda-bindings, numba-cuda, nvidia-ml-py, nvitop;
//!   pinned) in a Python environment at `target/pyenv`, and containerd 1.7, runc and busybox from
//!   Debian's archive in `target/containerd`, containerd 2 from Debian unstable in
//!   `target/containerd-2`, for the end-to-end tests); a no-op when all is there.
//! - `build-ebpf`: compile `ebpf/` for `bpfel-unknown-none` (the agent embeds the object).
//! - `fake-driver`: build the fake CUDA driver; print the directory holding `libcuda.so.1` (and
//!   `libnvidia-ml.so.1`: the fake is a fake NVML too).
//! - `image`: the agent's OCI image as an OCI archive, `target/vramguard-image.tar`, built
//!   offline from the release binaries and Debian's glibc (`--rootfs DIR`: the same root file
//!   system as a directory, which `deploy/Dockerfile` copies onto `scratch`); see [`image`].
//! - `validate-manifests`: check deploy/'s manifests against the Kubernetes schemas, offline.
//! - `install-files`: write deploy/install/'s files, one per way of installing, from the
//!   manifests (`--check`: fail unless the committed ones are up to date); see [`install`].
//! - `test`: everything above, the checks of the sources (the install files, `install`; the
//!   agent's layering, `layers`; no
//!   tracked file pointing outside the repository, `standalone`), the image (`image`, which
//!   the DaemonSet's end-to-end test runs), then every test of the workspace, then the demo
//!   with its output and clean-up checked (`demo::check`).
//! - `demo`: the agent, the fake driver and sample workloads, end to end (needs root).
//! - `bench`: what the eBPF probes, the hook and the node agent cost; writes docs/BENCHMARKS.md
//!   (`--probes-only`: the probes' rows, printed; `--agent-only`: the node agent's section alone).
mod bench;
mod clients;
mod containerd;
mod demo;
mod image;
mod install;
mod layers;
mod manifests;
mod prometheus;
mod setup;
mod standalone;
mod suite;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "xtask", about = "vramguard project automation")]
struct Cli {
    #[command(subcommand)]
    command: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what is missing: the eBPF toolchain pieces (rust-src, bpf-linker), the manifests'
    /// validator, and the containerds the end-to-end tests run (target/containerd, target/containerd-2).
    Setup,
    /// Compile the eBPF programs for bpfel-unknown-none.
    BuildEbpf,
    /// Build the fake CUDA driver and print the directory that holds its libcuda.so.1 and libnvidia-ml.so.1.
    FakeDriver,
    /// Build the agent's OCI image (release agent, hook for glibc 2.31+, busybox, glibc) as an
    /// OCI archive, target/vramguard-image.tar.
    Image {
        /// Write the image's root file system to this directory instead (deploy/Dockerfile does).
        #[arg(long, value_name = "DIR")]
        rootfs: Option<PathBuf>,
    },
    /// Validate the Kubernetes manifests under deploy/ against the bundled schemas (offline).
    ValidateManifests,
    /// Write deploy/install/vramguard.yaml (NRI) and vramguard-dra.yaml (DRA and the webhook)
    /// from the manifests under deploy/.
    InstallFiles {
        /// Write nothing; fail if the committed files differ from what the sources give.
        #[arg(long)]
        check: bool,
    },
    /// Set up, build, and run every test (the end-to-end ones need root), then the demo, checked.
    Test,
    /// Run the agent against the fake driver with sample workloads and show what it sees.
    Demo {
        /// Then check the output and that nothing was left behind, as `cargo xtask test` does.
        #[arg(long)]
        check: bool,
        /// Run on this libcuda (a real GPU's driver, e.g. /usr/lib/x86_64-linux-gnu/libcuda.so.1)
        /// instead of the fake driver.
        #[arg(long, value_name = "PATH")]
        libcuda: Option<PathBuf>,
    },
    /// Measure what the probes, the hook and the node agent cost; write docs/BENCHMARKS.md.
    Bench {
        /// Only the eBPF probes' rows (no probes, the nop floor, ours), printed; the report is
        /// left as it is.
        #[arg(long, conflicts_with = "agent_only")]
        probes_only: bool,
        /// Only the node agent's measurement (release agent, 100 ledgers, with and without
        /// hostile tenants); rewrites its section of the report and keeps the rest.
        #[arg(long)]
        agent_only: bool,
        /// Only the first hooked process of a container (the agent's ledger, the hook's own,
        /// warm, no hook); rewrites its section of the report and keeps the rest.
        #[arg(long, conflicts_with_all = ["agent_only", "probes_only"])]
        cold_start_only: bool,
    },
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Task::Setup => setup::setup(),
        Task::BuildEbpf => build_ebpf().map(|object| println!("{}", object.display())),
        Task::FakeDriver => fake_driver().map(|dir| println!("{}", dir.display())),
        Task::Image { rootfs } => image::image(rootfs, image::Agent::Release),
        Task::ValidateManifests => manifests::validate(),
        Task::InstallFiles { check } => install::install_files(check),
        Task::Test => test(),
        Task::Demo { check, libcuda } => demo::demo(check, libcuda.map_or(demo::Driver::Fake, demo::Driver::Real)),
        Task::Bench { probes_only, agent_only, cold_start_only } => bench::bench(probes_only, agent_only, cold_start_only),
    }
}

/// The workspace root (the parent of xtask/).
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// The workspace's debug output directory.
pub fn debug_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target"))
        .join("debug")
}

/// Runs a command to completion, failing with its command line if it fails.
pub fn run(command: &mut Command) -> Result<()> {
    let status = command
        .status()
        .with_context(|| format!("cannot start {command:?}"))?;
    if !status.success() {
        bail!("{command:?} failed ({status})");
    }
    Ok(())
}

/// A cargo command for the workspace's own (stable) toolchain.
fn cargo() -> Command {
    let mut command = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    command.current_dir(root());
    command
}

fn build_ebpf() -> Result<PathBuf> {
    setup::require_ebpf_tools()?;
    let dir = root().join("ebpf");
    let mut command = Command::new("rustup");
    command
        .args(["run", setup::NIGHTLY, "cargo", "build", "--release"])
        .current_dir(&dir);
    // The outer cargo (stable) exports variables that would make the nightly build use the
    // stable compiler or the workspace's target directory.
    for variable in ["RUSTC", "RUSTC_WRAPPER", "RUSTUP_TOOLCHAIN", "CARGO_TARGET_DIR", "RUSTFLAGS", "CARGO"] {
        command.env_remove(variable);
    }
    run(&mut command).context("building the eBPF programs")?;
    Ok(dir.join("target/bpfel-unknown-none/release/vramguard"))
}

fn fake_driver() -> Result<PathBuf> {
    run(cargo().args(["build", "-p", "fakecuda", "-p", "workload"]))?;
    e2e::fake_driver_dir_in(&debug_dir())
}

fn test() -> Result<()> {
    setup::ebpf_tools()?;
    // The fetches (the network) while the build (the CPUs).
    let (fetched, built) = std::thread::scope(|scope| {
        let fetching = scope.spawn(setup::fetch);
        let built = build_all();
        (fetching.join(), built)
    });
    let fetched = fetched.map_err(|_| anyhow::anyhow!("the setup's fetches panicked")).and_then(|fetched| fetched);
    let binaries = match (fetched, built) {
        (Ok(()), Ok(binaries)) => binaries,
        (Err(fetch), Ok(_)) => return Err(fetch.context("the setup's fetches failed")),
        (Ok(()), Err(build)) => return Err(build),
        (Err(fetch), Err(build)) => bail!("the build failed: {build:#}; and the setup's fetches failed: {fetch:#}"),
    };
    install::install_files(true)?;
    manifests::validate()?;
    layers::check()?;
    standalone::check()?;
    // The agent's image, which tests/e2e/tests/daemonset.rs runs as the DaemonSet's pod: the
    // layout that ships, with the agent just built (CI builds the agent once, not twice).
    let start = std::time::Instant::now();
    image::image(None, image::Agent::Test)?;
    println!("image: built in {:.1?}", start.elapsed());
    let mut totals = suite::run(binaries)?;
    // The demo, as `cargo xtask demo` runs it, with its output and its clean-up checked.
    println!("\nrunning the demo (cargo xtask demo), its output checked");
    let demo = demo::check(&demo::Driver::Fake);
    match &demo {
        Ok(()) => {
            println!("test xtask demo ... ok");
            totals.0 += 1;
        }
        Err(error) => {
            println!("test xtask demo ... FAILED: {error:#}");
            totals.1 += 1;
        }
    }
    // One closing line for the whole run.
    println!("{} passed, {} failed", totals.0, totals.1);
    demo.context("the demo check failed")
}

/// The eBPF object, then every library, binary (agent, fake driver, workload, hook) and test
/// in one build; the test binaries.
fn build_all() -> Result<Vec<suite::Binary>> {
    build_ebpf()?;
    let started = std::time::Instant::now();
    let binaries = suite::build()?;
    e2e::fake_driver_dir_in(&debug_dir())?;
    println!("build: {} test binaries in {:.1?}", binaries.len(), started.elapsed());
    Ok(binaries)
}

/// The counts of a libtest summary: `test result: ok. 5 passed; 0 failed; ...`.
fn parse_test_result(line: &str) -> Option<(u64, u64)> {
    let rest = line.strip_prefix("test result: ")?;
    let count = |word: &str| -> Option<u64> {
        rest.split(';').find_map(|part| part.trim().trim_start_matches("ok. ").trim_start_matches("FAILED. ").strip_suffix(word)?.trim().parse().ok())
    };
    Some((count("passed")?, count("failed")?))
}

#[cfg(test)]
mod tests {
    use super::parse_test_result;

    #[test]
    fn reads_libtest_summaries() {
        let ok = "test result: ok. 9 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 21.63s";
        assert_eq!(parse_test_result(ok), Some((9, 0)));
        let failed = "test result: FAILED. 7 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out";
        assert_eq!(parse_test_result(failed), Some((7, 1)));
        assert_eq!(parse_test_result("test foo ... ok"), None);
    }
}
