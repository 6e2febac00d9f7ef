//! Offline validation of the Kubernetes manifests under `deploy/`.
//!
//! `cargo xtask setup` creates a Python virtual environment at `target/pyenv` (once) holding
//! `kubernetes-validate`, which bundles the Kubernetes JSON schemas, so validating needs no
//! network or cluster. `xtask/validate_manifests.py` does the checking (see its docstring).
use std::{path::PathBuf, process::Command};

use anyhow::{Context, Result};

use crate::{root, run};

/// The Kubernetes version the manifests are validated against.
pub const KUBERNETES_VERSION: &str = "1.30";
/// The validator, pinned: its schemas decide what passes.
const KUBERNETES_VALIDATE: &str = "kubernetes-validate==1.37.0";

/// The project's Python environment, `target/pyenv` (also holds the real CUDA clients the
/// end-to-end tests run: [`crate::clients`]).
pub fn pyenv() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target"))
        .join("pyenv")
}

/// The environment's interpreter.
pub fn python() -> PathBuf {
    pyenv().join("bin/python")
}

/// Whether the environment holds the pinned validator.
fn installed() -> bool {
    let version = KUBERNETES_VALIDATE.rsplit("==").next().unwrap_or_default();
    Command::new(python())
        .args(["-c", &format!("import yaml, kubernetes_validate.version as v; assert v.__version__ == {version:?}")])
        .output()
        .is_ok_and(|output| output.status.success())
}

/// Creates the environment if it is missing and installs the validator if it is not there.
pub fn setup() -> Result<()> {
    if installed() {
        println!("setup: {KUBERNETES_VALIDATE} in {}: present", pyenv().display());
        return Ok(());
    }
    create_pyenv()?;
    println!("setup: installing {KUBERNETES_VALIDATE}");
    run(Command::new(python()).args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", KUBERNETES_VALIDATE, "pyyaml"]))
        .context("installing kubernetes-validate")
}

/// Creates the environment unless it exists.
pub fn create_pyenv() -> Result<()> {
    if !python().exists() {
        println!("setup: creating the Python environment {}", pyenv().display());
        run(Command::new("python3").arg("-m").arg("venv").arg(pyenv()))
            .context("creating the project's Python environment (needs python3 with venv)")?;
    }
    Ok(())
}

/// Validates every manifest under deploy/; fails naming each file and error.
pub fn validate() -> Result<()> {
    if !installed() {
        anyhow::bail!("{KUBERNETES_VALIDATE} is not installed in {}: run `cargo xtask setup`", pyenv().display());
    }
    run(Command::new(python())
        .arg(root().join("xtask/validate_manifests.py"))
        .args([KUBERNETES_VERSION, &root().to_string_lossy()]))
    .context("the manifests under deploy/ do not validate")
}
