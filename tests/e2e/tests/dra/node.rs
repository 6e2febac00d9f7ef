//! What the DRA tests on a real containerd share: stand-ins for the GPUs' device nodes, the
//! hooked workload run in a container, the agent's record of a container, a claim ledger's
//! devices.
use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};
use e2e::agent::{agent_bin, Agent};
use e2e::containerd::{workload_path, ContainerId, Containerd};
use serde_json::Value;

/// A stand-in for GPU `n`'s device node: a character device with /dev/null's numbers at
/// `<dir>/nvidia<n>` (made in the test's own directory, never in /dev).
pub fn stand_in_gpu_node(dir: &Path, n: u32) -> Result<PathBuf> {
    stand_in_node(dir, &format!("nvidia{n}"))
}

/// A stand-in for the driver's device node `name` (`nvidiactl`, …), as [`stand_in_gpu_node`].
pub fn stand_in_node(dir: &Path, name: &str) -> Result<PathBuf> {
    let path = dir.join(name);
    if !path.exists() {
        let out = std::process::Command::new("mknod").arg(&path).args(["c", "1", "3"]).output()?;
        ensure!(out.status.success(), "mknod {}: {}", path.display(), String::from_utf8_lossy(&out.stderr));
    }
    Ok(path)
}

/// Runs `fakecuda-workload` with these steps in `container`: its output lines (an error if it
/// exits non-zero).
pub fn workload(containerd: &Containerd, container: &ContainerId, steps: &[&str]) -> Result<Vec<String>> {
    let workload = workload_path();
    let argv: Vec<&str> = [workload.as_str()].into_iter().chain(steps.iter().copied()).collect();
    let out = containerd.exec_sync(container, &argv)?;
    ensure!(out.exit_code == 0, "{argv:?} in the container: {out:?}");
    Ok(out.stdout.lines().map(str::to_owned).collect())
}

/// The agent's record of provisioned container `id` (its audit's `provisioned` row).
pub fn provisioned(agent: &Agent, id: &ContainerId) -> Result<Option<Value>> {
    let audit = agent.audit()?;
    let rows = audit["provisioned"].as_array().context("no provisioned list in the audit")?;
    Ok(rows.iter().find(|r| r["container_id"] == id.0.as_str()).cloned())
}

/// (index, `field`) of each device of the ledger at `path` (`vramguard inspect --json`).
pub fn ledger_devices(path: &Path, field: &str) -> Result<Vec<(u64, u64)>> {
    let out = std::process::Command::new(agent_bin()?).args(["inspect", "--json"]).arg(path).output()?;
    ensure!(out.status.success(), "inspect: {}", String::from_utf8_lossy(&out.stderr));
    let report: Value = serde_json::from_slice(&out.stdout)?;
    let devices = report["devices"].as_array().with_context(|| format!("no devices in {report}"))?;
    devices.iter().map(|d| Ok((d["index"].as_u64().context("index")?, d[field].as_u64().with_context(|| field.to_string())?))).collect()
}
