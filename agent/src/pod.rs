//! Which Kubernetes pod and container a process belongs to, from its cgroup path: the
//! kubelet names a pod's cgroup after the pod's UID, and the container runtime names the
//! container's cgroup after the container id. Pure functions of the text of
//! `/proc/<pid>/cgroup`, but for [`of_pid`] which reads it.
//!
//! Layouts understood (anything before them, such as `/..` components a reader in another
//! cgroup namespace sees, or a kind node's `/kubelet.slice`, is skipped):
//!
//! * systemd driver: `…/kubepods[-<qos>]-pod<uid>.slice/<runtime>-<id>.scope`, where the
//!   UID's dashes are written as underscores and `<runtime>` is `cri-containerd`, `crio` or
//!   `docker` (e.g. `/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234_5678.slice/cri-containerd-abc.scope`);
//! * cgroupfs driver: `…/kubepods[/<qos>]/pod<uid>/<id>` (the id optionally with one of the
//!   runtime prefixes above).
//!
//! In `/proc/<pid>/cgroup` the cgroup v2 line (`0::/path`) is preferred; on a v1 or hybrid
//! host the v1 lines (`N:controllers:/path`) are tried after it. Anything else (a process
//! outside any pod, a pod-level cgroup with no container, a malformed name) gives `None`.
//!
//! The path comes from the kernel, so unlike the names a hook records in the ledger it
//! cannot be forged by the workload.
use std::fs;

/// The pod UID (with dashes) and the container id of a process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodIdentity {
    pub pod_uid: String,
    pub container_id: String,
}

/// Runtime prefixes of a container's cgroup name.
const RUNTIME_PREFIXES: [&str; 3] = ["cri-containerd-", "crio-", "docker-"];

/// The pod and container of host process `pid`, from `/proc/<pid>/cgroup`.
pub fn of_pid(pid: u32) -> Option<PodIdentity> {
    from_proc_cgroup(&fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?)
}

/// The pod and container named by the text of a `/proc/<pid>/cgroup` file: its cgroup v2
/// line first, then its v1 lines in order.
pub fn from_proc_cgroup(text: &str) -> Option<PodIdentity> {
    let entries: Vec<(&str, &str)> = text
        .lines()
        .filter_map(|line| {
            let mut fields = line.splitn(3, ':');
            let (hierarchy, _controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
            Some((hierarchy, path))
        })
        .collect();
    let v2 = entries.iter().filter(|(hierarchy, _)| *hierarchy == "0");
    let v1 = entries.iter().filter(|(hierarchy, _)| *hierarchy != "0");
    v2.chain(v1).find_map(|(_, path)| from_cgroup_path(path))
}

/// The pod and container a cgroup path names (systemd or cgroupfs driver).
pub fn from_cgroup_path(path: &str) -> Option<PodIdentity> {
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    // The container is the last component; the pod the one before it.
    let (&container, rest) = parts.split_last()?;
    let (&pod, ancestors) = rest.split_last()?;
    systemd(pod, container).or_else(|| cgroupfs(ancestors, pod, container))
}

/// `kubepods[-<qos>]-pod<uid>.slice` / `<runtime>-<id>.scope`.
fn systemd(pod: &str, container: &str) -> Option<PodIdentity> {
    let slice = pod.strip_suffix(".slice")?;
    let at = slice.rfind("-pod")?;
    if !slice[..at].split('-').any(|word| word == "kubepods") {
        return None;
    }
    let pod_uid = uid(&slice[at + "-pod".len()..].replace('_', "-"))?;
    let scope = container.strip_suffix(".scope")?;
    let id = RUNTIME_PREFIXES.iter().find_map(|prefix| scope.strip_prefix(prefix))?;
    Some(PodIdentity { pod_uid, container_id: container_id(id)? })
}

/// `kubepods[/<qos>]/pod<uid>/<id>`.
fn cgroupfs(ancestors: &[&str], pod: &str, container: &str) -> Option<PodIdentity> {
    let kubepods = ancestors.iter().rposition(|part| *part == "kubepods")?;
    // At most the QoS class between `kubepods` and the pod.
    match &ancestors[kubepods + 1..] {
        [] => {}
        [qos] if matches!(*qos, "burstable" | "besteffort" | "guaranteed") => {}
        _ => return None,
    }
    let pod_uid = uid(pod.strip_prefix("pod")?)?;
    let id = RUNTIME_PREFIXES.iter().find_map(|prefix| container.strip_prefix(prefix)).unwrap_or(container);
    Some(PodIdentity { pod_uid, container_id: container_id(id)? })
}

/// A pod UID: hex digits and dashes (an API pod's UUID, or a static pod's 32-digit hash).
fn uid(text: &str) -> Option<String> {
    let digits = text.chars().filter(char::is_ascii_hexdigit).count();
    let valid = (16..=64).contains(&text.len())
        && digits >= 16
        && text.chars().all(|c| c.is_ascii_hexdigit() || c == '-')
        && !text.starts_with('-')
        && !text.ends_with('-');
    valid.then(|| text.to_ascii_lowercase())
}

/// A container id: hex digits (64 from containerd, CRI-O and Docker; shorter ones accepted).
fn container_id(text: &str) -> Option<String> {
    let valid = (12..=128).contains(&text.len()) && text.chars().all(|c| c.is_ascii_hexdigit());
    valid.then(|| text.to_ascii_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "8f6b3f4c-2f7e-4d1a-9c3b-1e2d3c4b5a69";
    const ID: &str = "4a5b6c7d8e9f00112233445566778899aabbccddeeff00112233445566778899";

    fn expected() -> Option<PodIdentity> {
        Some(PodIdentity { pod_uid: UID.into(), container_id: ID.into() })
    }

    fn systemd_uid() -> String {
        UID.replace('-', "_")
    }

    #[test]
    fn systemd_driver_with_every_runtime_and_qos() {
        let u = systemd_uid();
        for runtime in ["cri-containerd", "crio", "docker"] {
            for (qos_slice, pod_slice) in [
                ("/kubepods-burstable.slice", format!("kubepods-burstable-pod{u}.slice")),
                ("/kubepods-besteffort.slice", format!("kubepods-besteffort-pod{u}.slice")),
                ("", format!("kubepods-pod{u}.slice")),
            ] {
                let path = format!("/kubepods.slice{qos_slice}/{pod_slice}/{runtime}-{ID}.scope");
                assert_eq!(from_cgroup_path(&path), expected(), "{path}");
            }
        }
        // A kind node (kubelet under its own slice), seen from another cgroup namespace.
        let path = format!(
            "/../../kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod{u}.slice/cri-containerd-{ID}.scope"
        );
        assert_eq!(from_cgroup_path(&path), expected());
    }

    #[test]
    fn cgroupfs_driver() {
        for path in [
            format!("/kubepods/burstable/pod{UID}/{ID}"),
            format!("/kubepods/besteffort/pod{UID}/{ID}"),
            format!("/kubepods/pod{UID}/{ID}"),
            format!("/kubepods/pod{UID}/crio-{ID}"),
            format!("/kubepods/burstable/pod{UID}/{}", ID.to_uppercase()),
        ] {
            assert_eq!(from_cgroup_path(&path), expected(), "{path}");
        }
        // A static pod's UID is a 32-digit hash.
        let hash = "0123456789abcdef0123456789abcdef";
        assert_eq!(
            from_cgroup_path(&format!("/kubepods/pod{hash}/{ID}")).map(|p| p.pod_uid),
            Some(hash.to_string())
        );
    }

    #[test]
    fn anything_else_is_none() {
        let u = systemd_uid();
        for path in [
            String::new(),
            "/".into(),
            "/user.slice/user-0.slice/session-1.scope".into(),
            "/system.slice/containerd.service".into(),
            "/docker/4a5b6c7d8e9f0011".into(),
            // Pod level, no container.
            format!("/kubepods/burstable/pod{UID}"),
            format!("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice"),
            // CRI-O's conmon, not the container.
            format!("/kubepods.slice/kubepods-pod{u}.slice/crio-conmon-{ID}.scope"),
            // Not under kubepods.
            format!("/other/burstable/pod{UID}/{ID}"),
            format!("/other.slice/other-pod{u}.slice/cri-containerd-{ID}.scope"),
            // Malformed UID or id, unknown runtime, unknown level.
            format!("/kubepods/pod{}/{ID}", "zz-not-a-uid-at-all-zzzzzzzzzz"),
            format!("/kubepods/pod{UID}/not-hex"),
            format!("/kubepods.slice/kubepods-pod{u}.slice/rkt-{ID}.scope"),
            format!("/kubepods/weird/deeper/pod{UID}/{ID}"),
            format!("/kubepods/pod{UID}/{ID}/extra"),
        ] {
            assert_eq!(from_cgroup_path(&path), None, "{path}");
        }
    }

    #[test]
    fn proc_cgroup_files_v2_and_hybrid() {
        let u = systemd_uid();
        let v2 = format!("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice/cri-containerd-{ID}.scope\n");
        assert_eq!(from_proc_cgroup(&v2), expected());
        // Hybrid: v1 controllers plus an unrelated unified line.
        let hybrid = format!(
            "12:pids:/kubepods/burstable/pod{UID}/{ID}\n4:cpu,cpuacct:/kubepods/burstable/pod{UID}/{ID}\n1:name=systemd:/user.slice\n0::/\n"
        );
        assert_eq!(from_proc_cgroup(&hybrid), expected());
        assert_eq!(from_proc_cgroup("0::/user.slice/user-0.slice/session-3.scope\n"), None);
        assert_eq!(from_proc_cgroup("garbage without colons\n"), None);
        assert_eq!(from_proc_cgroup(""), None);
    }

    #[test]
    fn this_process_is_in_no_pod_or_reads_as_one() {
        // Whatever this test runs in, reading a live process's file must not fail loudly.
        let _ = of_pid(std::process::id());
        assert_eq!(of_pid(u32::MAX), None);
    }
}
