//! The CDI spec of a prepared claim: one file per claim in `--cdi-dir`
//! (`gpu.vramguard.io-<claim uid>.json`), one CDI device per share (`gpu.vramguard.io/claim=
//! <claim uid>-gpu-<N>`), returned to the kubelet, which hands the names to the runtime.
//!
//! Each device's edits give the container GPU `N`'s device node (`/dev/nvidia<N>`, from the
//! host's node of that name or, where the nodes live elsewhere, from [`write_in`]'s directory);
//! the spec's own edits, applied once whatever number of its devices a container gets, give it
//! the driver's control nodes a CUDA program opens beside its GPUs ([`CONTROL_NODES`]:
//! `nvidiactl`, `nvidia-uvm`, `nvidia-uvm-tools`, `nvidia-modeset`, those that are there when
//! the claim is prepared: the runtime fails a container whose spec names a node that is not),
//! which name no GPU (the NRI side counts `/dev/nvidia<N>` alone), and mount
//! the claim's directory (`<state-dir>/dra/claims/<claim uid>`, created here, empty) read-only
//! at [`claim_mount`] (`/run/vramguard/claims/<claim uid>`: a container of two claims gets
//! both). That mount is the runtime's word for which claim the container belongs to: the NRI
//! side ([`crate::provision::claim`]) reads its host path from the container's OCI spec, never
//! the container's environment (the pod spec sets env; only the runtime sets a mount's host
//! path from a CDI spec). The env value [`CLAIM_ENV`] is for people and tools. The driver's
//! libraries are not the spec's: the image's, or the NVIDIA container toolkit's (deploy/README.md).
//!
//! `cdiVersion` 0.3.0, the lowest that carries device nodes, mounts and env; 0.5.0 where a
//! device node has a `hostPath` (the lowest that carries one). containerd 1.7.24 (Debian
//! trixie's CDI library) accepts both.
use std::fs;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde_json::json;

use super::{Prepared, DRIVER};

/// The CDI class of the driver's devices (`<vendor>/<class>`, the vendor being [`DRIVER`]).
pub const CLASS: &str = "claim";
/// The CDI version written: the lowest that carries the edits below.
pub const CDI_VERSION: &str = "0.3.0";
/// The CDI version written when a device node comes from another host path than its own.
pub const CDI_VERSION_HOST_PATH: &str = "0.5.0";
/// Where a container sees its claims' directories (one per claim, named by its UID).
pub const CLAIMS_MOUNT: &str = "/run/vramguard/claims";
/// Where the host's GPU device nodes are.
pub const DEVICE_DIR: &str = "/dev";
/// The env value naming the claim, for people and tools (not trusted by the agent).
pub const CLAIM_ENV: &str = "VRAMGUARD_DRA_CLAIM";
/// The driver's device nodes that are no GPU's, given to every container of a claim where
/// the host has them (the NVIDIA container toolkit gives the same).
pub const CONTROL_NODES: [&str; 4] = ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"];

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

/// The directory on the host holding every prepared claim's directory.
pub fn claims_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("dra").join("claims")
}

/// The claim's directory on the host, mounted into its containers.
pub fn claim_dir(state_dir: &Path, uid: &str) -> PathBuf {
    claims_dir(state_dir).join(uid)
}

/// Where a container sees claim `uid`'s directory.
pub fn claim_mount(uid: &str) -> String {
    format!("{CLAIMS_MOUNT}/{uid}")
}

/// Whether `uid` can be a claim's UID: the API server's UIDs are UUIDs; anything that could
/// leave a directory, or be more than a name, is not.
pub fn valid_uid(uid: &str) -> bool {
    !uid.is_empty() && uid.len() <= 128 && uid.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
}

/// Where the GPUs' device nodes are: on the host (`dir`, what the spec names: the runtime
/// resolves it on the host) and as the agent sees that directory (`view`: in the DaemonSet a
/// read-only mount of the host's `/dev`, since the agent container's own `/dev` is what the
/// NVIDIA runtime gave it, without `nvidia-uvm` under the `utility` capability).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Nodes {
    pub dir: PathBuf,
    pub view: PathBuf,
}

impl Nodes {
    /// The nodes in `dir`, seen there.
    pub fn at(dir: &Path) -> Nodes {
        Nodes { dir: dir.to_path_buf(), view: dir.to_path_buf() }
    }

    /// The host's `/dev`, seen there.
    pub fn host() -> Nodes {
        Nodes::at(Path::new(DEVICE_DIR))
    }
}

/// Writes the claim's directory and its spec (replacing an earlier one, atomically), with the
/// host's GPU device nodes ([`DEVICE_DIR`]).
pub fn write(cdi_dir: &Path, state_dir: &Path, prepared: &Prepared) -> Result<PathBuf, String> {
    write_in(cdi_dir, state_dir, &Nodes::host(), prepared).map(|(path, _)| path)
}

/// The claim's spec: one device per GPU, GPU `N`'s node `<nodes.dir>/nvidia<N>` (a node
/// elsewhere than `/dev` is a `hostPath` of CDI 0.5.0), the control nodes [`Nodes::view`]
/// shows, the claim's directory mounted.
pub fn spec(state_dir: &Path, nodes: &Nodes, prepared: &Prepared) -> serde_json::Value {
    let dir = claim_dir(state_dir, &prepared.uid);
    let elsewhere = nodes.dir != Path::new(DEVICE_DIR);
    let node = |name: &str| {
        let mut node = json!({"path": format!("{DEVICE_DIR}/{name}")});
        if elsewhere {
            node["hostPath"] = json!(nodes.dir.join(name));
        }
        node
    };
    let mut devices: Vec<serde_json::Value> = Vec::new();
    let mut gpus = std::collections::BTreeSet::new();
    // One device per GPU: two shares of one claim on one GPU are one CDI device.
    for share in prepared.shares.iter().filter(|share| gpus.insert(share.gpu)) {
        devices.push(json!({
            "name": device(&prepared.uid, share.gpu),
            "containerEdits": {"deviceNodes": [node(&format!("nvidia{}", share.gpu))]},
        }));
    }
    let controls: Vec<serde_json::Value> = CONTROL_NODES
        .iter()
        .filter(|name| fs::metadata(nodes.view.join(name)).is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_char_device(&m.file_type())))
        .map(|name| node(name))
        .collect();
    let mut edits = json!({
        "env": [format!("{CLAIM_ENV}={}", prepared.uid)],
        "mounts": [{"hostPath": dir, "containerPath": claim_mount(&prepared.uid), "options": ["ro", "bind", "nosuid", "nodev", "noexec"]}],
    });
    if !controls.is_empty() {
        edits["deviceNodes"] = json!(controls);
    }
    json!({
        "cdiVersion": if elsewhere { CDI_VERSION_HOST_PATH } else { CDI_VERSION },
        "kind": format!("{DRIVER}/{CLASS}"),
        "devices": devices,
        "containerEdits": edits,
    })
}

/// Makes the claim's directory and spec what they should be: the spec written (through a
/// temporary file, synced, renamed into place, the directory synced) unless the file there
/// already has exactly its bytes. Returns the spec's path and whether it was written: a
/// repeated prepare, or an agent starting after a reboot emptied the CDI directory (a tmpfs
/// at `/var/run/cdi`), writes what is missing or different and nothing else.
pub fn write_in(cdi_dir: &Path, state_dir: &Path, nodes: &Nodes, prepared: &Prepared) -> Result<(PathBuf, bool), String> {
    if !valid_uid(&prepared.uid) {
        return Err(format!("claim UID {:?} is not a UID", prepared.uid));
    }
    let dir = claim_dir(state_dir, &prepared.uid);
    fs::DirBuilder::new().recursive(true).mode(0o755).create(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let path = spec_path(cdi_dir, &prepared.uid);
    let bytes = serde_json::to_vec_pretty(&spec(state_dir, nodes, prepared)).map_err(|e| e.to_string())?;
    if fs::read(&path).is_ok_and(|there| there == bytes) {
        return Ok((path, false));
    }
    fs::DirBuilder::new().recursive(true).mode(0o755).create(cdi_dir).map_err(|e| format!("cannot create {}: {e}", cdi_dir.display()))?;
    let temporary = cdi_dir.join(format!(".{DRIVER}-{}.json.new", prepared.uid));
    durable_replace(&temporary, &path, &bytes, 0o644).map_err(|e| format!("cannot write the CDI spec {}: {e}", path.display()))?;
    Ok((path, true))
}

/// Writes `bytes` to `path` (mode `mode`) so that a crash leaves the old file or the new one,
/// whole, and the new one survives a power loss once this returns: through `temporary`
/// (synced), renamed into place, then the directory synced. `temporary` is removed on failure.
pub fn durable_replace(temporary: &Path, path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    let written = (|| {
        let mut file = fs::OpenOptions::new().write(true).create(true).truncate(true).mode(mode).open(temporary)?;
        std::io::Write::write_all(&mut file, bytes)?;
        file.sync_all()?;
        fs::rename(temporary, path)?;
        sync_dir(path)
    })();
    if written.is_err() {
        let _ = fs::remove_file(temporary);
    }
    written
}

/// Syncs the directory holding `path` (a rename or removal there is then on disk).
pub fn sync_dir(path: &Path) -> std::io::Result<()> {
    match path.parent() {
        Some(dir) => fs::File::open(dir)?.sync_all(),
        None => Ok(()),
    }
}

/// The UIDs of the claims whose spec is in `cdi_dir` or whose directory is under `state_dir`
/// (this driver's files only; a name that is not a UID is no claim's).
pub fn written_uids(cdi_dir: &Path, state_dir: &Path) -> Result<std::collections::BTreeSet<String>, String> {
    let mut uids = std::collections::BTreeSet::new();
    let prefix = format!("{DRIVER}-");
    for (dir, spec) in [(cdi_dir.to_path_buf(), true), (claims_dir(state_dir), false)] {
        let entries = match fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => continue,
            Err(error) => return Err(format!("cannot list {}: {error}", dir.display())),
        };
        for entry in entries {
            let name = entry.map_err(|e| format!("cannot list {}: {e}", dir.display()))?.file_name();
            let Some(name) = name.to_str() else { continue };
            let uid = if spec { name.strip_prefix(&prefix).and_then(|rest| rest.strip_suffix(".json")) } else { Some(name) };
            if let Some(uid) = uid.filter(|uid| valid_uid(uid)) {
                uids.insert(uid.to_owned());
            }
        }
    }
    Ok(uids)
}

/// Removes the claim's spec and directory, each removal synced (its directory's); what is
/// already gone is no error.
pub fn remove(cdi_dir: &Path, state_dir: &Path, uid: &str) -> Result<(), String> {
    if !valid_uid(uid) {
        return Err(format!("claim UID {uid:?} is not a UID"));
    }
    let path = spec_path(cdi_dir, uid);
    match fs::remove_file(&path) {
        Ok(()) => sync_dir(&path).map_err(|e| format!("cannot sync {}: {e}", cdi_dir.display()))?,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => return Err(format!("cannot remove the CDI spec {}: {error}", path.display())),
    }
    let dir = claim_dir(state_dir, uid);
    match fs::remove_dir_all(&dir) {
        Ok(()) => sync_dir(&dir).map_err(|e| format!("cannot sync {}: {e}", claims_dir(state_dir).display())),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(error) => Err(format!("cannot remove {}: {error}", dir.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prepared::Share;

    fn share(gpu: u32, memory: u64) -> Share {
        Share {
            request: "gpu".into(),
            pool: "node-1".into(),
            device: crate::prepared::device_name(gpu),
            gpu,
            share_id: Some(format!("00000000-0000-4000-8000-00000000000{gpu}")),
            memory,
            cdi_device: qualified("6f1c0d36-1", gpu),
            admin_access: false,
        }
    }

    fn claim(uid: &str, shares: Vec<Share>) -> Prepared {
        Prepared { uid: uid.into(), namespace: "team".into(), name: "c".into(), shares }
    }

    fn tempdir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("vramguard-cdi-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("temp dir");
        dir
    }

    fn read(path: &Path) -> serde_json::Value {
        serde_json::from_slice(&fs::read(path).expect("spec")).expect("JSON")
    }

    #[test]
    fn a_claim_s_spec_names_a_device_per_gpu_and_mounts_the_claim_s_directory() {
        let root = tempdir("spec");
        let (cdi, state) = (root.join("cdi"), root.join("state"));
        let uid = "6f1c0d36-1";
        // Two shares on GPU 1 (two requests) and one on GPU 3.
        let prepared = claim(uid, vec![share(1, 8 << 30), share(1, 1 << 30), share(3, 2 << 30)]);
        let path = write(&cdi, &state, &prepared).expect("written");
        assert_eq!(path, cdi.join(format!("gpu.vramguard.io-{uid}.json")));
        let spec = read(&path);
        assert_eq!(spec["cdiVersion"], CDI_VERSION);
        assert_eq!(spec["kind"], "gpu.vramguard.io/claim");
        let devices = spec["devices"].as_array().expect("devices");
        let names: Vec<&str> = devices.iter().filter_map(|d| d["name"].as_str()).collect();
        assert_eq!(names, [format!("{uid}-gpu-1"), format!("{uid}-gpu-3")]);
        assert_eq!(devices[1]["containerEdits"]["deviceNodes"], json!([{"path": "/dev/nvidia3"}]));
        assert_eq!(qualified(uid, 3), format!("gpu.vramguard.io/claim={uid}-gpu-3"), "what the kubelet hands on resolves here");
        let mount = &spec["containerEdits"]["mounts"][0];
        assert_eq!(mount["hostPath"], json!(claim_dir(&state, uid)));
        assert_eq!(mount["containerPath"], format!("/run/vramguard/claims/{uid}"));
        assert!(mount["options"].as_array().expect("options").contains(&json!("ro")));
        assert_eq!(spec["containerEdits"]["env"], json!([format!("VRAMGUARD_DRA_CLAIM={uid}")]));
        // The host's control nodes, those it has (none where it has no NVIDIA driver).
        let controls: Vec<&str> = spec["containerEdits"]["deviceNodes"].as_array().into_iter().flatten().filter_map(|n| n["path"].as_str()).collect();
        let there: Vec<String> = CONTROL_NODES.iter().filter(|name| Path::new("/dev").join(name).exists()).map(|name| format!("/dev/{name}")).collect();
        assert_eq!(controls, there);
        assert!(claim_dir(&state, uid).is_dir());
        // Written again (a repeated prepare): replaced, no temporary left beside it.
        write(&cdi, &state, &claim(uid, vec![share(2, 1 << 30)])).expect("again");
        assert_eq!(read(&path)["devices"][0]["name"], format!("{uid}-gpu-2"));
        assert_eq!(fs::read_dir(&cdi).expect("dir").count(), 1);

        remove(&cdi, &state, uid).expect("removed");
        assert!(!path.exists() && !claim_dir(&state, uid).exists());
        remove(&cdi, &state, uid).expect("what is gone is no error");
        fs::remove_dir_all(&root).expect("cleanup");
    }

    #[test]
    fn device_nodes_from_elsewhere_are_host_paths_of_cdi_0_5() {
        let root = tempdir("host-path");
        let (path, _) = write_in(&root.join("cdi"), &root.join("state"), &Nodes::at(&root.join("nodes")), &claim("u-2", vec![share(0, 1)])).expect("written");
        let spec = read(&path);
        assert_eq!(spec["cdiVersion"], CDI_VERSION_HOST_PATH);
        let node = &spec["devices"][0]["containerEdits"]["deviceNodes"][0];
        assert_eq!((node["path"].as_str(), node["hostPath"].as_str()), (Some("/dev/nvidia0"), root.join("nodes/nvidia0").to_str()));
        fs::remove_dir_all(&root).expect("cleanup");
    }

    /// Stand-ins for device nodes: character devices with /dev/null's numbers.
    fn stand_in(dir: &Path, name: &str) {
        let path = dir.join(name);
        let out = std::process::Command::new("mknod").arg(&path).args(["c", "1", "3"]).output().expect("mknod");
        assert!(out.status.success(), "mknod {}: {}", path.display(), String::from_utf8_lossy(&out.stderr));
    }

    #[test]
    fn the_control_nodes_there_are_given_once_for_the_claim_and_nothing_else() {
        let root = tempdir("controls");
        let nodes = root.join("nodes");
        fs::create_dir_all(&nodes).expect("nodes");
        for name in ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-modeset"] {
            stand_in(&nodes, name);
        }
        // Not character devices: left out as missing ones are (nvidia-uvm-tools).
        fs::write(nodes.join("nvidia-uvm-tools"), b"").expect("a file");
        fs::create_dir_all(nodes.join("nvidia-caps")).expect("a dir");
        let (path, _) = write_in(&root.join("cdi"), &root.join("state"), &Nodes::at(&nodes), &claim("u-3", vec![share(0, 1), share(1, 1)])).expect("written");
        let spec = read(&path);
        assert_eq!(spec["cdiVersion"], CDI_VERSION_HOST_PATH, "host paths: the lowest version that carries them");
        let at = |name: &str| json!({"path": format!("/dev/{name}"), "hostPath": nodes.join(name)});
        assert_eq!(spec["containerEdits"]["deviceNodes"], json!([at("nvidiactl"), at("nvidia-uvm"), at("nvidia-modeset")]));
        assert_eq!(spec["devices"][0]["containerEdits"]["deviceNodes"], json!([at("nvidia0")]), "each device its GPU alone");
        assert_eq!(spec["devices"][1]["containerEdits"]["deviceNodes"], json!([at("nvidia1")]));
        // A node without them: none.
        let bare = root.join("bare");
        fs::create_dir_all(&bare).expect("bare");
        let spec = read(&write_in(&root.join("cdi"), &root.join("state"), &Nodes::at(&bare), &claim("u-4", vec![share(0, 1)])).expect("written").0);
        assert!(spec["containerEdits"].get("deviceNodes").is_none(), "{spec}");
        // The agent's own view lacks them (its container's /dev, without nvidia-uvm under the
        // NVIDIA runtime's `utility`), the host's has them: the host's view decides, and the
        // spec names the host's paths.
        let spec = read(&write_in(&root.join("cdi"), &root.join("state"), &Nodes { dir: bare.clone(), view: nodes.clone() }, &claim("u-5", vec![share(0, 1)])).expect("written").0);
        let at_host = |name: &str| json!({"path": format!("/dev/{name}"), "hostPath": bare.join(name)});
        assert_eq!(spec["containerEdits"]["deviceNodes"], json!([at_host("nvidiactl"), at_host("nvidia-uvm"), at_host("nvidia-modeset")]));
        fs::remove_dir_all(&root).expect("cleanup");
    }

    #[test]
    fn what_is_not_a_uid_names_no_file() {
        let root = tempdir("uids");
        for bad in ["", "..", "../x", "a/b", "a b", "a\0b", &"x".repeat(129)] {
            assert!(!valid_uid(bad), "{bad:?}");
            assert!(write(&root.join("cdi"), &root.join("state"), &claim(bad, vec![share(0, 1)])).is_err(), "{bad:?}");
            assert!(remove(&root.join("cdi"), &root.join("state"), bad).is_err(), "{bad:?}");
        }
        assert!(valid_uid("6f1c0d36-9b7e-4c3a-8f00-0123456789ab"));
        assert!(!root.join("cdi").exists() && !root.join("state").exists(), "nothing made");
        fs::remove_dir_all(&root).expect("cleanup");
    }
}
