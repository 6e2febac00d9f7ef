//! The real CUDA clients the end-to-end tests run over the fake driver
//! (`tests/e2e/tests/clients.rs`): NVIDIA's `cuda-bindings`, `numba-cuda` and
//! `nvidia-ml-py`, plus `nvitop`, installed by `cargo xtask setup` into the project's Python
//! environment ([`crate::manifests::pyenv`]) at exact versions, their dependencies pinned too,
//! so a run installs the same bytes every time. `nvidia-cuda-runtime` is there because
//! numba-cuda loads `libcudart` at import; no other CUDA library is needed (nothing is
//! compiled for the GPU).
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result};

use crate::manifests::{create_pyenv, python};
use crate::run;

/// Every package, pinned (the four clients first, then what they pull in).
pub const PACKAGES: &[&str] = &[
    "cuda-bindings==13.5.0",
    "numba-cuda==0.30.4",
    "nvidia-ml-py==13.615.71",
    "nvitop==1.7.2",
    "nvidia-cuda-runtime==13.5.37",
    "cuda-core==1.2.2",
    "cuda-pathfinder==1.9.0",
    "numba==0.68.1",
    "llvmlite==0.50.0",
    "numpy==2.4.6",
    "psutil==7.2.2",
    "packaging==26.3",
];

/// Whether every pinned package is installed at its version.
fn installed() -> bool {
    let check = format!(
        "import importlib.metadata as m, sys\n\
         want = {:?}\n\
         sys.exit(any(m.version(p.split('==')[0]) != p.split('==')[1] for p in want))",
        PACKAGES
    );
    Command::new(python()).args(["-c", &check]).output().is_ok_and(|o| o.status.success())
}

/// Installs the clients unless all are present; says how long pip took.
pub fn setup() -> Result<()> {
    if installed() {
        println!("setup: CUDA clients ({} pinned packages): present", PACKAGES.len());
        return Ok(());
    }
    create_pyenv()?;
    println!("setup: installing the CUDA clients: {}", PACKAGES.join(" "));
    let start = Instant::now();
    run(Command::new(python())
        .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps"])
        .args(PACKAGES))
    .context("installing the CUDA clients (cuda-bindings, numba-cuda, nvidia-ml-py, nvitop) from PyPI")?;
    println!("setup: CUDA clients installed in {:.0?}", start.elapsed());
    Ok(())
}
