//! Offline validation of the Kubernetes manifests under `deploy/`.
//!
//! `cargo xtask setup` creates a Python virtual environment at `target/pyenv` (once) holding
//! `kubernetes-validate`, which bundles the Kubernetes JSON schemas, so validating needs no
//! network or cluster. `xtask/validate_manifests.py` does the checking (see its docstring).
//! The environment also holds a CEL interpreter, `cel-python`, with which
//! `xtask/slice_policy_cel.py` evaluates the expressions of deploy/dra/slice-policy.yaml (the
//! agent's ResourceSlice admission policy) over admission requests, each with the decision the
//! API server must come to.
use std::{path::PathBuf, process::Command};

use anyhow::{Context, Result};

use crate::{root, run};

/// The Kubernetes version the manifests are validated against.
pub const KUBERNETES_VERSION: &str = "1.30";
/// The validator, pinned: its schemas decide what passes.
const KUBERNETES_VALIDATE: &str = "kubernetes-validate==1.37.0";
/// The CEL interpreter the admission policy is evaluated with (module `celpy`), then what it
/// pulls in, each pinned (installed without resolving, so the same bytes every run; PyYAML,
/// which it needs too, comes with the validator).
const CEL: &[&str] = &[
    "cel-python==0.5.0",
    "lark==1.3.1",
    "google-re2==1.1.20251105",
    "jmespath==1.1.0",
    "pendulum==3.3.0",
    "python-dateutil==4.0.0",
    "tzdata==2026.6",
];

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

/// Whether the environment holds the CEL interpreter and its dependencies at their versions.
fn cel_installed() -> bool {
    let check = format!(
        "import importlib.metadata as m, sys\n\
         want = {CEL:?}\n\
         sys.exit(any(m.version(p.split('==')[0]) != p.split('==')[1] for p in want))"
    );
    Command::new(python()).args(["-c", &check]).output().is_ok_and(|output| output.status.success())
}

/// Creates the environment if it is missing and installs the validator and the CEL
/// interpreter where they are not there.
pub fn setup() -> Result<()> {
    if installed() {
        println!("setup: {KUBERNETES_VALIDATE} in {}: present", pyenv().display());
    } else {
        create_pyenv()?;
        println!("setup: installing {KUBERNETES_VALIDATE}");
        run(Command::new(python()).args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", KUBERNETES_VALIDATE, "pyyaml"]))
            .context("installing kubernetes-validate")?;
    }
    if cel_installed() {
        println!("setup: {}: present", CEL[0]);
        return Ok(());
    }
    println!("setup: installing {}", CEL.join(" "));
    run(Command::new(python())
        .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps"])
        .args(CEL))
    .context("installing the CEL interpreter (cel-python) from PyPI")
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

/// Validates every manifest under deploy/, then evaluates the ResourceSlice admission
/// policy's CEL over its cases; fails naming each file and error, or each case that failed.
pub fn validate() -> Result<()> {
    if !installed() {
        anyhow::bail!("{KUBERNETES_VALIDATE} is not installed in {}: run `cargo xtask setup`", pyenv().display());
    }
    if !cel_installed() {
        anyhow::bail!("{} is not installed in {}: run `cargo xtask setup`", CEL[0], pyenv().display());
    }
    run(Command::new(python())
        .arg(root().join("xtask/validate_manifests.py"))
        .args([KUBERNETES_VERSION, &root().to_string_lossy()]))
    .context("the manifests under deploy/ do not validate")?;
    run(Command::new(python()).arg(root().join("xtask/slice_policy_cel.py")).arg(root()))
        .context("deploy/dra/slice-policy.yaml's CEL does not decide its admission requests as it should")
}
