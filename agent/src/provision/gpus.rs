//! Which of the node's GPUs a container was given, as the container runtime says: the only
//! answer the quota's ledger, the cgroup limit and the over-commit check use.
//!
//! Trusted (the runtime's: `docs/security.md`, rule 5): the device nodes in the container's OCI spec
//! (`linux.devices`, as NRI hands it over in CreateContainer: what the kubelet's device plugin
//! or CDI put there) and the CDI device names the runtime reports (NRI's `CDI_devices`, newer
//! NRI) or the container's CDI annotations (`cdi.k8s.io/...`, set by the kubelet from the
//! device plugin's answer). Never the container's environment: `NVIDIA_VISIBLE_DEVICES` is
//! the pod spec's to set.
//!
//! * A device node `/dev/nvidia<N>` is GPU `N` (the driver's minor number, which is the index
//!   `--gpu-memory` counts in; `nvidiactl`, `nvidia-uvm`, `nvidia-caps/…` are not GPUs).
//! * A CDI name of class `gpu` from an NVIDIA vendor (`nvidia.com/gpu`,
//!   `k8s.device-plugin.nvidia.com/gpu`): `=<N>` is GPU `N`, `=<N>:<M>` (a MIG instance) is on
//!   GPU `N`, `=all` is every GPU. Other CDI devices are not GPUs.
//! * Device nodes, when there are any, are what the container can open: they alone decide. CDI
//!   names decide only when the spec has no GPU device nodes yet.
//! * Undetermined (no GPU named, a CDI name that is not an index such as a UUID, an index
//!   past the node's GPUs): every GPU, never fewer; the caller logs it and counts it.
use std::collections::{BTreeMap, BTreeSet};

/// The GPUs of a container, as indices of the node's `gpus` (sorted, no repeats, at least
/// one), or why the runtime's description does not say (then every GPU is the answer).
pub fn given(devices: &[String], cdi: &[String], annotations: &BTreeMap<String, String>, gpus: u32) -> Result<Vec<usize>, String> {
    let in_range = |index: usize, named: &str| {
        if index < gpus as usize {
            Ok(index)
        } else {
            Err(format!("{named} names GPU {index}, the node has {gpus}"))
        }
    };
    let mut found = BTreeSet::new();
    for path in devices {
        if let Some(index) = device_node_index(path) {
            found.insert(in_range(index, path)?);
        }
    }
    if !found.is_empty() {
        return Ok(found.into_iter().collect());
    }
    let annotated = annotations
        .iter()
        .filter(|(key, _)| key.starts_with(CDI_ANNOTATION_PREFIX))
        .flat_map(|(_, value)| value.split(',').map(str::trim));
    for name in cdi.iter().map(String::as_str).chain(annotated) {
        match cdi_gpu(name) {
            None => {}
            Some(CdiGpu::All) => return Ok((0..gpus as usize).collect()),
            Some(CdiGpu::Index(index)) => {
                found.insert(in_range(index, name)?);
            }
            Some(CdiGpu::Unmapped) => return Err(format!("CDI device {name:?} is not a GPU index the agent can map")),
        }
    }
    if found.is_empty() {
        return Err("no GPU device node (/dev/nvidia<N>) nor NVIDIA CDI device in the container's spec".into());
    }
    Ok(found.into_iter().collect())
}

/// The prefix of the annotations in which the kubelet passes CDI device names to the runtime.
const CDI_ANNOTATION_PREFIX: &str = "cdi.k8s.io/";

/// `N` of a device node at `/dev/nvidia<N>`.
fn device_node_index(path: &str) -> Option<usize> {
    let digits = path.strip_prefix("/dev/nvidia")?;
    index(digits)
}

/// A decimal index without sign or leading zeros (`0`, `12`), as the driver names its minors.
fn index(digits: &str) -> Option<usize> {
    let plain = !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) && (digits == "0" || !digits.starts_with('0'));
    plain.then(|| digits.parse().ok()).flatten()
}

enum CdiGpu {
    All,
    Index(usize),
    /// An NVIDIA GPU named otherwise (a UUID): which one, the agent cannot tell.
    Unmapped,
}

/// What a fully qualified CDI name (`vendor/class=name`) says of the node's GPUs; `None`: not
/// an NVIDIA GPU.
fn cdi_gpu(name: &str) -> Option<CdiGpu> {
    let (kind, device) = name.split_once('=')?;
    let (vendor, class) = kind.split_once('/')?;
    let nvidia = vendor == "nvidia.com" || vendor.ends_with(".nvidia.com");
    if !nvidia || class != "gpu" {
        return None;
    }
    if device == "all" {
        return Some(CdiGpu::All);
    }
    let gpu = device.split_once(':').map_or(device, |(gpu, _)| gpu);
    Some(index(gpu).map_or(CdiGpu::Unmapped, CdiGpu::Index))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| s.to_string()).collect()
    }

    fn none() -> BTreeMap<String, String> {
        BTreeMap::new()
    }

    #[test]
    fn device_nodes_are_gpu_indices() {
        let devices = strings(&["/dev/null", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia3", "/dev/nvidia1", "/dev/nvidia-caps/nvidia-cap1"]);
        assert_eq!(given(&devices, &[], &none(), 4), Ok(vec![1, 3]));
        assert_eq!(given(&strings(&["/dev/nvidia0", "/dev/nvidia0"]), &[], &none(), 1), Ok(vec![0]));
        // Not a GPU's node: no index.
        for path in ["/dev/nvidia", "/dev/nvidia01", "/dev/nvidia+1", "/dev/nvidia1x", "/dev/dri/card1", "/host/dev/nvidia1"] {
            assert_eq!(device_node_index(path), None, "{path}");
        }
    }

    #[test]
    fn device_nodes_past_the_node_s_gpus_are_undetermined() {
        let error = given(&strings(&["/dev/nvidia7"]), &[], &none(), 2).expect_err("GPU 7 of 2");
        assert!(error.contains("GPU 7") && error.contains("has 2"), "{error}");
    }

    #[test]
    fn cdi_names_from_the_runtime_and_its_annotations() {
        assert_eq!(given(&[], &strings(&["nvidia.com/gpu=2", "vendor.com/net=0"]), &none(), 4), Ok(vec![2]));
        assert_eq!(given(&[], &strings(&["nvidia.com/gpu=all"]), &none(), 3), Ok(vec![0, 1, 2]));
        assert_eq!(given(&[], &strings(&["nvidia.com/gpu=1:0"]), &none(), 2), Ok(vec![1]), "a MIG instance is on its GPU");
        let annotations = BTreeMap::from([
            ("cdi.k8s.io/nvidia-device-plugin_abc".to_string(), "k8s.device-plugin.nvidia.com/gpu=3, nvidia.com/gpu=0".to_string()),
            ("other/x".to_string(), "nvidia.com/gpu=1".to_string()),
        ]);
        assert_eq!(given(&[], &[], &annotations, 4), Ok(vec![0, 3]), "only cdi.k8s.io/ annotations");
        let error = given(&[], &strings(&["nvidia.com/gpu=GPU-8f6b2c1e"]), &none(), 2).expect_err("a UUID");
        assert!(error.contains("GPU-8f6b2c1e"), "{error}");
    }

    #[test]
    fn device_nodes_decide_over_cdi_names() {
        let cdi = strings(&["nvidia.com/gpu=GPU-8f6b2c1e", "nvidia.com/gpu=all"]);
        assert_eq!(given(&strings(&["/dev/nvidia1"]), &cdi, &none(), 4), Ok(vec![1]));
    }

    #[test]
    fn nothing_named_is_undetermined() {
        let error = given(&strings(&["/dev/null", "/dev/nvidiactl"]), &strings(&["vendor.com/net=0"]), &none(), 2).expect_err("no GPU");
        assert!(error.contains("no GPU device node"), "{error}");
    }
}
