//! The Kubernetes API's side (`--kube`), reached as `run --kube` reaches it: the API server
//! and the node; the RBAC the agent needs, by trying what it does (get its node, list its
//! node's pods, a dry-run patch of its node's status; with `--dra`, list ResourceSlices and a
//! dry-run create of one); NVIDIA's device plugin (`nvidia.com/gpu` on the node) and NVIDIA's
//! DRA driver (`gpu.nvidia.com` slices on the node) beside the agent; the
//! `DRAConsumableCapacity` gate, from a dry-run ResourceSlice in the shared form read back.
use std::{collections::BTreeMap, future::Future, time::Duration};

use k8s_openapi::{
    api::{
        core::v1::{Node, Pod},
        resource::v1::{Device, DeviceCapacity, ResourcePool, ResourceSlice, ResourceSliceSpec},
    },
    apimachinery::pkg::{api::resource::Quantity, apis::meta::v1::ObjectMeta},
};
use kube::{
    api::{ListParams, Patch, PatchParams, PostParams},
    Api, Client,
};

use super::Check;
use crate::{
    dra::slices::slice_name,
    prepared::{device_name, DRIVER, MEMORY},
    provision::kube::{ApiArgs, KubeError},
};

/// How long one request may take.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// NVIDIA's device plugin's extended resource.
pub const NVIDIA_GPU: &str = "nvidia.com/gpu";
/// NVIDIA's DRA driver.
pub const NVIDIA_DRIVER: &str = "gpu.nvidia.com";

/// How a request came out, as far as the checks care.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The API server answered this code.
    Status(u16, String),
    /// No answer: not reached, TLS, a timeout.
    Unreached(String),
}

impl Failure {
    fn of(error: KubeError) -> Failure {
        match error {
            KubeError::Status { code, message, .. } => Failure::Status(code, message),
            error => Failure::Unreached(error.to_string()),
        }
    }

    fn denied(&self) -> bool {
        matches!(self, Failure::Status(401 | 403, _))
    }

    fn text(&self) -> String {
        match self {
            Failure::Status(code, message) => format!("{code} {message}"),
            Failure::Unreached(reason) => reason.clone(),
        }
    }
}

/// What the API checks found.
#[derive(Clone, Debug)]
pub struct Facts {
    /// The node's name.
    pub node_name: String,
    pub node: Result<Node, Failure>,
    pub pods: Result<(), Failure>,
    pub node_status: Result<(), Failure>,
    pub slices: Result<Vec<ResourceSlice>, Failure>,
    /// The dry-run create's answer.
    pub probe: Result<ResourceSlice, Failure>,
}

/// The checks of `--kube`: one `kube-api` line where the API server cannot be asked.
pub async fn checks(api: &ApiArgs, node: Option<&str>) -> Vec<Check> {
    let Some(node) = node.filter(|n| !n.is_empty()) else {
        return vec![Check::fail("kube-api", "no node name", "give --node NAME (the DaemonSet's pod has NODE_NAME)")];
    };
    let client = match api.config().await.and_then(|config| config.client()) {
        Ok(client) => client,
        Err(error) => return vec![Check::fail("kube-api", error.to_string(), "give --kube-api (with --kube-token-file, --kube-ca-file) or --kubeconfig; in the pod, the service account's files")],
    };
    let facts = ask(client, node).await;
    if let Err(Failure::Unreached(reason)) = &facts.node {
        return vec![Check::fail("kube-api", format!("the API server is not reached: {reason}"), "check the address, the CA and the network policy between the node and the API server")];
    }
    vec![api_check(&facts), rbac(&facts), device_plugin(&facts), dra_drivers(&facts), dra_gate(&facts)]
}

async fn timed<T>(what: &str, request: impl Future<Output = Result<T, kube::Error>>) -> Result<T, Failure> {
    match tokio::time::timeout(REQUEST_TIMEOUT, request).await {
        Ok(answer) => answer.map_err(|error| Failure::of(KubeError::from_kube(what, error))),
        Err(_) => Err(Failure::Unreached(format!("{what}: no answer within {REQUEST_TIMEOUT:?}"))),
    }
}

/// Asks the API server; stops after the node's GET where it is not reached.
async fn ask(client: Client, node: &str) -> Facts {
    let nodes: Api<Node> = Api::all(client.clone());
    let got = timed("getting the node", nodes.get(node)).await;
    let mut facts = Facts {
        node_name: node.to_owned(),
        node: got,
        pods: Err(Failure::Unreached("not asked".into())),
        node_status: Err(Failure::Unreached("not asked".into())),
        slices: Err(Failure::Unreached("not asked".into())),
        probe: Err(Failure::Unreached("not asked".into())),
    };
    if matches!(facts.node, Err(Failure::Unreached(_))) {
        return facts;
    }
    let on_node = ListParams::default().fields(&format!("spec.nodeName={node}"));
    let pods: Api<Pod> = Api::all(client.clone());
    facts.pods = timed("listing the node's pods", pods.list(&on_node.clone().limit(1))).await.map(|_| ());
    let dry_run = PatchParams { dry_run: true, field_manager: Some("vramguard-doctor".into()), ..PatchParams::default() };
    let nothing: Patch<()> = Patch::Json(json_patch::Patch(Vec::new()));
    facts.node_status = timed("patching the node's status (dry run)", nodes.patch_status(node, &dry_run, &nothing)).await.map(|_| ());
    let slices: Api<ResourceSlice> = Api::all(client);
    facts.slices = timed("listing the node's ResourceSlices", slices.list(&on_node)).await.map(|list| list.items);
    let create = PostParams { dry_run: true, field_manager: Some("vramguard-doctor".into()) };
    facts.probe = timed("creating a ResourceSlice (dry run)", slices.create(&create, &probe_slice(node))).await;
    facts
}

/// A slice of one GPU in the shared form (`allowMultipleAllocations`), for a dry-run create.
pub fn probe_slice(node: &str) -> ResourceSlice {
    let capacity = DeviceCapacity { value: Quantity("1Gi".into()), request_policy: None };
    let device = Device { name: device_name(0), allow_multiple_allocations: Some(true), capacity: Some(BTreeMap::from([(MEMORY.to_owned(), capacity)])), ..Device::default() };
    ResourceSlice {
        metadata: ObjectMeta { name: Some(format!("{}-doctor", slice_name(node, 0))), ..ObjectMeta::default() },
        spec: ResourceSliceSpec {
            driver: DRIVER.to_owned(),
            node_name: Some(node.to_owned()),
            pool: ResourcePool { name: node.to_owned(), generation: 1, resource_slice_count: 1 },
            devices: Some(vec![device]),
            ..ResourceSliceSpec::default()
        },
    }
}

pub fn api_check(facts: &Facts) -> Check {
    let node = &facts.node_name;
    match &facts.node {
        Ok(_) => Check::ok("kube-api", format!("the API server answers; node {node} found")),
        Err(Failure::Status(401, message)) => Check::fail("kube-api", format!("the API server refuses the token: {message}"), "check the service account's token (the pod's, or --kube-token-file)"),
        Err(Failure::Status(404, _)) => Check::fail("kube-api", format!("the API server knows no node {node}"), "give the name the API server knows (--node; the DaemonSet's NODE_NAME is spec.nodeName)"),
        Err(failure) if failure.denied() => Check::ok("kube-api", "the API server answers (the node's GET is refused: see kube-rbac)"),
        Err(failure) => Check::fail("kube-api", format!("getting node {node}: {}", failure.text()), "check the API server's health"),
    }
}

pub fn rbac(facts: &Facts) -> Check {
    let required = [("get nodes", facts.node.as_ref().map(|_| ())), ("list pods", facts.pods.as_ref().map(|_| ())), ("patch nodes/status (dry run)", facts.node_status.as_ref().map(|_| ()))];
    let dra = [("list resourceslices", facts.slices.as_ref().map(|_| ())), ("create resourceslices (dry run)", facts.probe.as_ref().map(|_| ()))];
    let (required_denied, dra_denied) = (refused(&required), refused(&dra));
    let others: Vec<String> = required.iter().chain(&dra).filter_map(|(what, r)| r.err().filter(|f| !f.denied()).map(|f| format!("{what}: {}", f.text()))).collect();
    if !required_denied.is_empty() {
        return Check::fail("kube-rbac", format!("refused: {}", required_denied.join(", ")), "apply deploy/install/vramguard.yaml again (its ClusterRole vramguard-agent and the binding to the agent's service account; from deploy/kubernetes/rbac.yaml)");
    }
    if !dra_denied.is_empty() {
        return Check::warn("kube-rbac", format!("refused: {} (needed with --dra)", dra_denied.join(", ")), "with --dra, install with deploy/install/vramguard-dra.yaml (its DRA rules come from deploy/dra/rbac.yaml)");
    }
    if !others.is_empty() {
        return Check::warn("kube-rbac", format!("allowed as far as asked; not answered: {}", others.join("; ")), "see the lines below; a 404 on resourceslices: the API server has no resource.k8s.io/v1 (DRA needs Kubernetes 1.34+)");
    }
    Check::ok("kube-rbac", "allowed: get nodes, list pods, patch nodes/status, list and create resourceslices (dry runs)")
}

/// The requests the API server refused.
fn refused<'a>(asked: &[(&'a str, Result<(), &Failure>)]) -> Vec<&'a str> {
    asked.iter().filter(|(_, r)| r.is_err_and(Failure::denied)).map(|(what, _)| *what).collect()
}

pub fn device_plugin(facts: &Facts) -> Check {
    let Ok(node) = &facts.node else {
        return Check::warn("device-plugin", "not checked: the node was not read", "see kube-api and kube-rbac");
    };
    let status = node.status.as_ref();
    let published = [status.and_then(|s| s.allocatable.as_ref()), status.and_then(|s| s.capacity.as_ref())]
        .into_iter()
        .flatten()
        .find_map(|resources| resources.get(NVIDIA_GPU).filter(|q| q.0.trim() != "0"));
    match published {
        Some(count) => Check::warn(
            "device-plugin",
            format!("the node publishes {NVIDIA_GPU}: {}: also published by NVIDIA's device plugin: keep it off DRA nodes", count.0),
            "label the node and keep NVIDIA's device plugin off it (deploy/README.md, \"Keep NVIDIA's device plugin off the DRA nodes\")",
        ),
        None => Check::ok("device-plugin", format!("no {NVIDIA_GPU} on node {}", facts.node_name)),
    }
}

pub fn dra_drivers(facts: &Facts) -> Check {
    let slices = match &facts.slices {
        Ok(slices) => slices,
        Err(failure) => return Check::warn("dra-drivers", format!("not checked: {}", failure.text()), "see kube-rbac"),
    };
    let mut drivers: BTreeMap<&str, usize> = BTreeMap::new();
    for slice in slices {
        *drivers.entry(slice.spec.driver.as_str()).or_default() += 1;
    }
    let listed: Vec<String> = drivers.iter().map(|(driver, n)| format!("{driver} ({n})")).collect();
    let listed = if listed.is_empty() { "none".to_owned() } else { listed.join(", ") };
    if drivers.contains_key(NVIDIA_DRIVER) {
        Check::warn(
            "dra-drivers",
            format!("NVIDIA's DRA driver ({NVIDIA_DRIVER}) publishes GPUs of this node too; slices on the node by driver: {listed}"),
            "keep one DRA driver for the GPUs of a node: take NVIDIA's off this node (or don't run --dra here)",
        )
    } else {
        Check::ok("dra-drivers", format!("no other GPU DRA driver on the node; slices by driver: {listed}"))
    }
}

pub fn dra_gate(facts: &Facts) -> Check {
    match &facts.probe {
        Ok(answer) => {
            let kept = answer.spec.devices.iter().flatten().any(|d| d.allow_multiple_allocations == Some(true));
            if kept {
                Check::ok("dra-gate", "DRAConsumableCapacity on: a dry-run ResourceSlice keeps allowMultipleAllocations (claims share a GPU)")
            } else {
                Check::warn(
                    "dra-gate",
                    "DRAConsumableCapacity off: each GPU goes whole to one claim (the API server dropped allowMultipleAllocations from a dry-run ResourceSlice)",
                    "turn the gate on in kube-apiserver, kube-scheduler and every kubelet (--feature-gates=DRAConsumableCapacity=true; on by default from 1.36)",
                )
            }
        }
        Err(Failure::Status(404, _)) => Check::warn("dra-gate", "no resource.k8s.io/v1 on the API server: no DRA", "DRA needs Kubernetes 1.34 or later (only for --dra)"),
        Err(Failure::Status(409, _)) => Check::warn("dra-gate", "cannot tell: the probe's ResourceSlice name is taken", "delete the ResourceSlice named <node>-gpu.vramguard.io-0-doctor"),
        Err(failure) => Check::warn("dra-gate", format!("cannot tell: {}", failure.text()), "see kube-rbac (only for --dra)"),
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::NodeStatus;

    use super::*;
    use crate::doctor::Status;

    fn node(resources: &[(&str, &str)]) -> Node {
        let map = resources.iter().map(|(k, v)| (k.to_string(), Quantity(v.to_string()))).collect();
        Node { status: Some(NodeStatus { allocatable: Some(map), ..NodeStatus::default() }), ..Node::default() }
    }

    fn slice(driver: &str) -> ResourceSlice {
        let mut slice = probe_slice("gpu-node-7");
        slice.spec.driver = driver.to_owned();
        slice
    }

    fn up() -> Facts {
        Facts { node_name: "gpu-node-7".into(), node: Ok(node(&[("cpu", "16")])), pods: Ok(()), node_status: Ok(()), slices: Ok(vec![slice(DRIVER)]), probe: Ok(probe_slice("gpu-node-7")) }
    }

    fn denied() -> Failure {
        Failure::Status(403, "Forbidden".into())
    }

    #[test]
    fn all_well() {
        let got: Vec<(&str, Status)> = [api_check, rbac, device_plugin, dra_drivers, dra_gate].iter().map(|f| f(&up())).map(|c| (c.check, c.status)).collect();
        assert!(got.iter().all(|(_, s)| *s == Status::Ok), "{got:?}");
    }

    #[test]
    fn the_api_server_and_the_node() {
        let facts = |node| Facts { node, ..up() };
        assert_eq!(api_check(&facts(Err(Failure::Status(401, "Unauthorized".into())))).status, Status::Fail);
        assert_eq!(api_check(&facts(Err(Failure::Status(404, "NotFound".into())))).status, Status::Fail);
        assert_eq!(api_check(&facts(Err(Failure::Status(500, "etcd".into())))).status, Status::Fail);
        assert_eq!(api_check(&facts(Err(denied()))).status, Status::Ok, "reached; RBAC says the rest");
    }

    #[test]
    fn rbac_required_fails_dra_warns() {
        let pods = rbac(&Facts { pods: Err(denied()), ..up() });
        assert_eq!(pods.status, Status::Fail);
        assert!(pods.detail.contains("list pods") && pods.fix.as_deref().unwrap_or_default().contains("deploy/install/vramguard.yaml"), "{pods:?}");
        assert_eq!(rbac(&Facts { node_status: Err(denied()), ..up() }).status, Status::Fail);
        let dra = rbac(&Facts { slices: Err(denied()), probe: Err(denied()), ..up() });
        assert_eq!(dra.status, Status::Warn);
        assert!(dra.fix.as_deref().unwrap_or_default().contains("deploy/install/vramguard-dra.yaml"), "{dra:?}");
        let old = rbac(&Facts { slices: Err(Failure::Status(404, "NotFound".into())), ..up() });
        assert_eq!(old.status, Status::Warn);
    }

    #[test]
    fn nvidias_device_plugin_on_the_node_warns() {
        let check = device_plugin(&Facts { node: Ok(node(&[("nvidia.com/gpu", "8")])), ..up() });
        assert_eq!(check.status, Status::Warn);
        assert!(check.detail.contains("also published by NVIDIA's device plugin: keep it off DRA nodes"), "{check:?}");
        assert_eq!(device_plugin(&Facts { node: Ok(node(&[("nvidia.com/gpu", "0")])), ..up() }).status, Status::Ok, "withdrawn");
        assert_eq!(device_plugin(&Facts { node: Err(denied()), ..up() }).status, Status::Warn);
    }

    #[test]
    fn nvidias_dra_driver_on_the_node_warns() {
        let check = dra_drivers(&Facts { slices: Ok(vec![slice(DRIVER), slice(NVIDIA_DRIVER)]), ..up() });
        assert_eq!(check.status, Status::Warn);
        assert!(check.detail.contains("gpu.nvidia.com (1)") && check.detail.contains("gpu.vramguard.io (1)"), "{check:?}");
        assert_eq!(dra_drivers(&Facts { slices: Err(denied()), ..up() }).status, Status::Warn);
    }

    #[test]
    fn the_gate_off_warns_with_the_reason() {
        let mut dropped = probe_slice("gpu-node-7");
        for device in dropped.spec.devices.iter_mut().flatten() {
            device.allow_multiple_allocations = None;
        }
        let check = dra_gate(&Facts { probe: Ok(dropped), ..up() });
        assert_eq!(check.status, Status::Warn);
        assert!(check.detail.contains("DRAConsumableCapacity off: each GPU goes whole to one claim"), "{check:?}");
        assert_eq!(dra_gate(&Facts { probe: Err(Failure::Status(404, "NotFound".into())), ..up() }).status, Status::Warn);
        assert_eq!(dra_gate(&Facts { probe: Err(Failure::Status(409, "AlreadyExists".into())), ..up() }).status, Status::Warn);
    }

    #[test]
    fn the_probe_is_one_shared_gpu_of_the_node() {
        let slice = probe_slice("n1");
        assert_eq!(slice.metadata.name.as_deref(), Some("n1-gpu.vramguard.io-0-doctor"));
        let json = serde_json::to_value(&slice).expect("json");
        assert_eq!(json["spec"]["devices"][0]["allowMultipleAllocations"], true);
        assert_eq!(json["spec"]["nodeName"], "n1");
    }
}
