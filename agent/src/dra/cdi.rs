//! The CDI spec of a prepared claim: one file per claim in `--cdi-dir`
//! (`gpu.vramguard.io-<claim uid>.json`), one CDI device per share (`gpu.vramguard.io/claim=
//! <claim uid>-gpu-<N>`), returned to the kubelet, which hands the names to the runtime.
//!
//! Each device's edits give the container GPU `N`'s device node and mount the claim's directory
//! (`<state-dir>/dra/claims/<claim uid>`, created here) read-only at [`CLAIM_MOUNT`]: the
//! runtime's word for which claim the container belongs to. The NRI side reads the mount's host
//! path from the container's OCI spec, never the container's environment (the pod spec sets
//! env; only the runtime sets mounts from host paths the tenant cannot name). The env value
//! [`CLAIM_ENV`] is for people and tools.
//!
//! `cdiVersion` 0.3.0: the lowest that carries device nodes, mounts and env.
use std::fs;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use serde_json::json;

use super::{Prepared, DRIVER};

/// The CDI class of the driver's devices (`<vendor>/<class>`, the vendor being [`DRIVER`]).
pub const CLASS: &str = "claim";
/// The CDI version written: the lowest that carries the edits below.
pub const CDI_VERSION: &str = "0.3.0";
/// Where a container sees its claim's directory.
pub const CLAIM_MOUNT: &str = "/run/vramguard/claim";
/// The env value naming the claim, for people and tools (not trusted by the agent).
pub const CLAIM_ENV: &str = "VRAMGUARD_DRA_CLAIM";

/// The CDI device name (unqualified) of claim `uid`'s share on GPU `gpu`.
pub fn device(uid: &str, gpu: u32) -> String {
    format!("{uid}-{}", super::device_name(gpu))
}

/// The fully qualified CDI name of claim `uid`'s share on GPU `gpu`, as the kubelet hands it on.
pub fn qualified(uid: &str, gpu: u32) -> String {
    format!("{DRIVER}/{CLASS}={}", device(uid, gpu))
}

/// The claim's spec file in `cdi_dir`.
pub fn spec_path(cdi_dir: &Path, uid: &str) -> PathBuf {
    cdi_dir.join(format!("{DRIVER}-{uid}.json"))
}

/// The claim's directory on the host, mounted into its containers.
pub fn claim_dir(state_dir: &Path, uid: &str) -> PathBuf {
    state_dir.join("dra").join("claims").join(uid)
}

/// Writes the claim's directory and its spec (replacing an earlier one, atomically).
pub fn write(cdi_dir: &Path, state_dir: &Path, prepared: &Prepared) -> Result<PathBuf, String> {
    // A UID is the API server's (a UUID); anything that could leave the directories is refused.
    if prepared.uid.is_empty() || !prepared.uid.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
        return Err(format!("claim UID {:?} is not a UID", prepared.uid));
    }
    let dir = claim_dir(state_dir, &prepared.uid);
    fs::DirBuilder::new().recursive(true).mode(0o755).create(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let devices: Vec<_> = prepared
        .shares
        .iter()
        .map(|share| {
            json!({
                "name": device(&prepared.uid, share.gpu),
                "containerEdits": {
                    "deviceNodes": [{"path": format!("/dev/nvidia{}", share.gpu)}],
                },
            })
        })
        .collect();
    let spec = json!({
        "cdiVersion": CDI_VERSION,
        "kind": format!("{DRIVER}/{CLASS}"),
        "devices": devices,
        "containerEdits": {
            "env": [format!("{CLAIM_ENV}={}", prepared.uid)],
            "mounts": [{"hostPath": dir, "containerPath": CLAIM_MOUNT, "options": ["ro", "bind", "nosuid", "nodev", "noexec"]}],
        },
    });
    let path = spec_path(cdi_dir, &prepared.uid);
    fs::DirBuilder::new().recursive(true).mode(0o755).create(cdi_dir).map_err(|e| format!("cannot create {}: {e}", cdi_dir.display()))?;
    let temporary = cdi_dir.join(format!(".{DRIVER}-{}.json.new", prepared.uid));
    let bytes = serde_json::to_vec_pretty(&spec).map_err(|e| e.to_string())?;
    fs::write(&temporary, bytes)
        .and_then(|()| fs::rename(&temporary, &path))
        .map_err(|e| {
            let _ = fs::remove_file(&temporary);
            format!("cannot write the CDI spec {}: {e}", path.display())
        })?;
    Ok(path)
}

/// Removes the claim's spec and directory; what is already gone is no error.
pub fn remove(cdi_dir: &Path, state_dir: &Path, uid: &str) -> Result<(), String> {
    let path = spec_path(cdi_dir, uid);
    match fs::remove_file(&path) {
        Ok(()) => {}
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => return Err(format!("cannot remove the CDI spec {}: {error}", path.display())),
    }
    let dir = claim_dir(state_dir, uid);
    match fs::remove_dir_all(&dir) {
        Ok(()) => Ok(()),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(error) => Err(format!("cannot remove {}: {error}", dir.display())),
    }
}
