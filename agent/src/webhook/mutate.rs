//! The mutation itself, pure: a pod in, the claims its containers need and the JSON patch
//! (RFC 6902) that turns it into a DRA pod out; no I/O.
//!
//! A container asks with `vramguard.io/gpu-memory` in its limits (requests equal to them, or
//! absent: the API defaults them to the limits), or in its requests alone (which the API
//! would refuse for an extended resource: converted all the same, since the claim is what
//! the user meant). For each such container, init containers included:
//!
//! * its size in bytes ([`parse_quantity`]): a limit and a request that differ, or a value
//!   that is not a whole number of bytes, refuse the pod with the container and the value
//!   named; zero removes the resource and adds no claim (a warning says so; the container's
//!   `nvidia.com/gpu`, if any, is left as it is);
//! * its GPUs ([`NVIDIA_GPU`], see [`Shape`]): without `nvidia.com/gpu` one GPU; with
//!   `nvidia.com/gpu: N` (limits, requests or both) N GPUs with the size on each, the old
//!   meaning of the extended resource beside NVIDIA's device plugin, and `nvidia.com/gpu` is
//!   removed from the container too: left there, the device plugin would allocate GPUs of its
//!   own beside the claim's (a container no claim accounts for, or one refused for want of
//!   them on a DRA node). N that is not a whole number, 0, more than [`MAX_GPUS`], or a limit
//!   and a request that differ refuse the pod, saying what to write;
//! * the resource is removed from its limits and requests;
//! * a pod claim, named in its `resources.claims`, made from the namespace's template for
//!   its [`Shape`] ([`template_name`]). Which claim ([`share`]): a main container and a
//!   sidecar (an init container with `restartPolicy: Always`, which runs beside the main
//!   ones) get one of their own, `vramguard-<container>` (see [`claim_entry`]): every such
//!   container had its own quota, and still has; two asking the same shape share the
//!   template, never the claim. An ordinary init container runs alone, before every main
//!   container starts, so it names a main container's claim when one has its number of GPUs
//!   and at least its size (the smallest such, the first on a tie): the pod holds the max of
//!   the two, not the sum, and the init container runs under that claim's quota (its
//!   processes are gone, their share of the claim's ledger with them, before the main
//!   container starts). Init containers that fit no main container's claim share one claim
//!   per number of GPUs among themselves (they run one at a time), that of the largest of
//!   them. A main container's claim is never grown to fit an init container: its quota is
//!   its limit for its whole life, and the webhook does not raise it; such an init
//!   container costs a claim of its own for the pod's life.
//!
//! A pod with no container asking gets no patch at all. The mutation is idempotent: once
//! applied, the pod asks for nothing, so a second call (`reinvocationPolicy: IfNeeded`)
//! leaves it alone.
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
};

use json_patch::{
    jsonptr::{PointerBuf, Token},
    AddOperation, Patch, PatchOperation, RemoveOperation,
};
use k8s_openapi::{
    api::core::v1::{Container, Pod},
    apimachinery::pkg::api::resource::Quantity,
};
use serde_json::{json, Value};

use crate::provision::kube::{parse_quantity, RESOURCE};

/// The prefix of the ResourceClaimTemplates the webhook writes, one per shape in a namespace.
pub const TEMPLATE_PREFIX: &str = "vramguard-gpu-memory-";
/// The prefix of the pod claims the webhook adds, one per container that owns one.
pub const ENTRY_PREFIX: &str = "vramguard-";
/// The longest pod claim name (a DNS label).
const LABEL_MAX: usize = 63;
/// NVIDIA's device plugin's extended resource: whole GPUs.
pub const NVIDIA_GPU: &str = "nvidia.com/gpu";
/// The most GPUs one claim can be given: resource.k8s.io/v1's limit on a claim's allocation
/// results (`AllocationResultsMaxSize`); the scheduler never allocates a request for more.
pub const MAX_GPUS: u32 = 32;

/// What one claim asks for: `bytes` of memory on each of `gpus` GPUs (one request of the
/// DeviceClass, `count: gpus`, `capacity.requests.memory: bytes`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Shape {
    pub bytes: u64,
    pub gpus: u32,
}

impl Shape {
    /// `bytes` on one GPU.
    pub const fn one(bytes: u64) -> Shape {
        Shape { bytes, gpus: 1 }
    }
}

impl fmt::Display for Shape {
    /// `8Gi`, or `8Gi x2` on two GPUs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&quantity_text(self.bytes))?;
        if self.gpus != 1 {
            write!(f, " x{}", self.gpus)?;
        }
        Ok(())
    }
}

/// What a pod needs: the shapes of the templates it names, and its patch. `patch` is empty
/// for a pod that asks for nothing.
#[derive(Debug, Default)]
pub struct Mutation {
    /// The distinct shapes the pod's claims are made from.
    pub shapes: BTreeSet<Shape>,
    pub patch: Vec<PatchOperation>,
    /// Said to the client that created the pod (e.g. a zero quota dropped).
    pub warnings: Vec<String>,
}

impl Mutation {
    /// The patch for the API's answer.
    pub fn into_patch(self) -> Patch {
        Patch(self.patch)
    }
}

/// Why a pod is refused: said to the user as it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Refusal(pub String);

/// Which list a container is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum List {
    Init,
    Main,
}

impl List {
    fn field(self) -> &'static str {
        match self {
            List::Init => "initContainers",
            List::Main => "containers",
        }
    }
}

/// When a container that asks runs, which decides whether it can share a claim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A main container: runs beside the others, for the pod's life.
    Main,
    /// An init container with `restartPolicy: Always`: runs beside the main containers.
    Sidecar,
    /// An ordinary init container: runs alone, to completion, before any main container.
    Init,
}

/// A container that asks, converted: where it is, its name, when it runs, its shape.
struct Asking<'a> {
    list: List,
    index: usize,
    container: &'a Container,
    role: Role,
    shape: Shape,
}

/// The pod's mutation: see the module's docs.
pub fn mutate(pod: &Pod) -> Result<Mutation, Refusal> {
    let mut mutation = Mutation::default();
    let Some(spec) = pod.spec.as_ref() else { return Ok(mutation) };
    let mut asking = Vec::new();
    let lists = [(List::Init, spec.init_containers.as_deref().unwrap_or_default()), (List::Main, spec.containers.as_slice())];
    for (list, containers) in lists {
        for (index, container) in containers.iter().enumerate() {
            let Some(asked) = asked(container)? else { continue };
            let resources = container_path(list, index).with_trailing_token("resources");
            if asked.value == 0 {
                remove_resource(&mut mutation.patch, &resources, RESOURCE, asked.in_limits, asked.in_requests);
                mutation.warnings.push(format!("container {:?}: {RESOURCE} of 0 removed: no GPU memory claimed", container.name));
                continue;
            }
            let gpus = gpus(container, asked.value)?;
            remove_resource(&mut mutation.patch, &resources, RESOURCE, asked.in_limits, asked.in_requests);
            if let Some(gpus) = &gpus {
                remove_resource(&mut mutation.patch, &resources, NVIDIA_GPU, gpus.in_limits, gpus.in_requests);
            }
            let role = match list {
                List::Main => Role::Main,
                List::Init if container.restart_policy.as_deref() == Some("Always") => Role::Sidecar,
                List::Init => Role::Init,
            };
            // At most MAX_GPUS, checked.
            let shape = Shape { bytes: asked.value, gpus: gpus.map_or(1, |g| u32::try_from(g.value).unwrap_or(MAX_GPUS)) };
            asking.push(Asking { list, index, container, role, shape });
        }
    }
    let owners = share(&asking.iter().map(|a| (a.role, a.shape)).collect::<Vec<_>>());
    let mut taken: BTreeSet<String> = spec.resource_claims.iter().flatten().map(|c| c.name.clone()).collect();
    let mut entries = Vec::new();
    for (i, a) in asking.iter().enumerate() {
        let owner = &asking[owners[i]];
        let entry = claim_entry(&owner.container.name);
        if owners[i] == i {
            if !taken.insert(entry.clone()) {
                return Err(Refusal(format!(
                    "container {:?}: the pod already has a resource claim named {entry:?}, the name vramguard gives the claim that replaces its {RESOURCE}",
                    a.container.name
                )));
            }
            entries.push(json!({"name": entry, "resourceClaimTemplateName": template_name(a.shape)}));
            mutation.shapes.insert(a.shape);
        }
        let claims = container_path(a.list, a.index).with_trailing_token("resources").with_trailing_token("claims");
        let claim = json!({"name": entry});
        match a.container.resources.as_ref().and_then(|r| r.claims.as_ref()) {
            Some(_) => mutation.patch.push(add(claims.with_trailing_token("-"), claim)),
            None => mutation.patch.push(add(claims, json!([claim]))),
        }
    }
    let claims = PointerBuf::from_tokens(["spec", "resourceClaims"]);
    if spec.resource_claims.is_some() {
        for entry in entries {
            mutation.patch.push(add(claims.with_trailing_token("-"), entry));
        }
    } else if !entries.is_empty() {
        mutation.patch.push(add(claims, Value::Array(entries)));
    }
    Ok(mutation)
}

/// Whose claim each container that asks names, given each one's role and shape in the pod's
/// order: the index of the claim's owner, the container itself for one that owns its claim
/// (whose shape is then the claim's). Main containers and sidecars own theirs; an ordinary
/// init container names the smallest main container's claim of its GPUs that holds its size
/// (the first on a tie), or else the claim of the largest ordinary init container of its
/// GPUs that fits no main container's claim either (the first on a tie), which owns it.
pub fn share(asking: &[(Role, Shape)]) -> Vec<usize> {
    let mut owners: Vec<usize> = (0..asking.len()).collect();
    // The init containers left to share among themselves, by number of GPUs: the owner so far.
    let mut largest: BTreeMap<u32, usize> = BTreeMap::new();
    let mut left = Vec::new();
    for (i, &(role, shape)) in asking.iter().enumerate() {
        if role != Role::Init {
            continue;
        }
        let main = asking
            .iter()
            .enumerate()
            .filter(|(_, (role, main))| *role == Role::Main && main.gpus == shape.gpus && main.bytes >= shape.bytes)
            .min_by_key(|(j, (_, main))| (main.bytes, *j));
        match main {
            Some((j, _)) => owners[i] = j,
            None => {
                left.push(i);
                let owner = largest.entry(shape.gpus).or_insert(i);
                if asking[*owner].1.bytes < shape.bytes {
                    *owner = i;
                }
            }
        }
    }
    for i in left {
        owners[i] = largest[&asking[i].1.gpus];
    }
    owners
}

/// Removes `resource` from the container's limits and requests, where it is.
fn remove_resource(patch: &mut Vec<PatchOperation>, resources: &PointerBuf, resource: &str, in_limits: bool, in_requests: bool) {
    for (field, there) in [("limits", in_limits), ("requests", in_requests)] {
        if there {
            patch.push(remove(resources.with_trailing_token(field).with_trailing_token(resource)));
        }
    }
}

/// A resource in a container's limits or requests: its value (both must be equal) and where
/// it is.
struct Found {
    value: u64,
    in_limits: bool,
    in_requests: bool,
}

type Quantities = Option<BTreeMap<String, Quantity>>;

/// `resource` in the container's limits and requests, each a whole number ([`parse_quantity`]);
/// `None` where it is in neither. A value that is not one is refused with `not_whole(field,
/// text)`, a limit and a request that differ with `differ(limit, request)`.
fn found(
    container: &Container,
    resource: &str,
    not_whole: impl Fn(&str, &str) -> String,
    differ: impl Fn(u64, u64) -> String,
) -> Result<Option<Found>, Refusal> {
    let Some(resources) = container.resources.as_ref() else { return Ok(None) };
    let value = |map: &Quantities, field: &str| {
        map.as_ref().and_then(|m| m.get(resource)).map(|q| parse_quantity(&q.0).ok_or_else(|| Refusal(not_whole(field, &q.0)))).transpose()
    };
    let limit = value(&resources.limits, "limits")?;
    let request = value(&resources.requests, "requests")?;
    let value = match (limit, request) {
        (None, None) => return Ok(None),
        (Some(limit), Some(request)) if limit != request => return Err(Refusal(differ(limit, request))),
        (Some(value), _) | (None, Some(value)) => value,
    };
    Ok(Some(Found { value, in_limits: limit.is_some(), in_requests: request.is_some() }))
}

/// The container's `vramguard.io/gpu-memory` in bytes, checked; `None` if it asks for none.
fn asked(container: &Container) -> Result<Option<Found>, Refusal> {
    let name = &container.name;
    found(
        container,
        RESOURCE,
        |field, text| format!("container {name:?}: {field}.{RESOURCE} {text:?} is not a quantity of whole bytes (e.g. 8Gi, 8192Mi, 8589934592)"),
        |limit, request| {
            format!("container {name:?}: requests.{RESOURCE} ({request} bytes) differs from limits.{RESOURCE} ({limit} bytes): they must be equal")
        },
    )
}

/// The container's `nvidia.com/gpu` beside its `bytes` of `vramguard.io/gpu-memory`, checked
/// (the value a number of GPUs, 1 to [`MAX_GPUS`]); `None` if it has none (one GPU).
fn gpus(container: &Container, bytes: u64) -> Result<Option<Found>, Refusal> {
    let name = &container.name;
    let size = quantity_text(bytes);
    let found = found(
        container,
        NVIDIA_GPU,
        |field, text| {
            format!(
                "container {name:?}: {field}.{NVIDIA_GPU} {text:?} is not a whole number of GPUs: beside {RESOURCE} it is the number of GPUs the quota is on, each with {size} (write e.g. {NVIDIA_GPU}: 2)"
            )
        },
        |limit, request| {
            format!("container {name:?}: requests.{NVIDIA_GPU} ({request}) differs from limits.{NVIDIA_GPU} ({limit}): write the same number of GPUs in both, or in limits alone")
        },
    )?;
    match found.as_ref().map(|f| f.value) {
        Some(0) => Err(Refusal(format!(
            "container {name:?}: {NVIDIA_GPU} is 0 but {RESOURCE} asks {size} on each of its GPUs: write {NVIDIA_GPU}: 1 or more, or remove {RESOURCE} from a container that needs no GPU"
        ))),
        Some(count) if count > u64::from(MAX_GPUS) => Err(Refusal(format!(
            "container {name:?}: {NVIDIA_GPU} {count} is more GPUs than one claim can be given ({MAX_GPUS}, the API's limit on a claim's devices): write {MAX_GPUS} or fewer"
        ))),
        _ => Ok(found),
    }
}

/// `/spec/<list>/<index>`.
fn container_path(list: List, index: usize) -> PointerBuf {
    PointerBuf::from_tokens([Token::new("spec"), Token::new(list.field()), Token::from(index)])
}

fn add(path: PointerBuf, value: Value) -> PatchOperation {
    PatchOperation::Add(AddOperation { path, value })
}

fn remove(path: PointerBuf) -> PatchOperation {
    PatchOperation::Remove(RemoveOperation { path })
}

/// The size's shortest exact spelling as a Kubernetes quantity: the suffix that leaves the
/// smallest number (binary first on a tie): `8Gi`, `8G`, `1536Mi`, `1000001` (no suffix).
pub fn quantity_text(bytes: u64) -> String {
    const SUFFIXES: [(&str, u64); 12] = [
        ("Ei", 1 << 60),
        ("Pi", 1 << 50),
        ("Ti", 1 << 40),
        ("Gi", 1 << 30),
        ("Mi", 1 << 20),
        ("Ki", 1 << 10),
        ("E", 1_000_000_000_000_000_000),
        ("P", 1_000_000_000_000_000),
        ("T", 1_000_000_000_000),
        ("G", 1_000_000_000),
        ("M", 1_000_000),
        ("k", 1_000),
    ];
    let best = SUFFIXES
        .iter()
        .filter(|(_, unit)| bytes != 0 && bytes.is_multiple_of(*unit))
        .min_by_key(|(_, unit)| bytes / unit);
    match best {
        Some((suffix, unit)) => format!("{}{suffix}", bytes / unit),
        None => bytes.to_string(),
    }
}

/// The namespace's template for `shape`: `vramguard-gpu-memory-8gi` on one GPU (the size's
/// shortest spelling, lowercase: `8g` is 8 GB, `8gi` 8 GiB), `vramguard-gpu-memory-8gi-x2` on
/// two (no size's spelling has a `-`).
pub fn template_name(shape: Shape) -> String {
    let size = quantity_text(shape.bytes).to_ascii_lowercase();
    match shape.gpus {
        1 => format!("{TEMPLATE_PREFIX}{size}"),
        gpus => format!("{TEMPLATE_PREFIX}{size}-x{gpus}"),
    }
}

/// The pod claim of container `name`: `vramguard-<name>`, a DNS label; a name too long for
/// that keeps its first characters and adds a hash of the whole name (FNV-1a: fixed, so the
/// same pod always gets the same names).
pub fn claim_entry(name: &str) -> String {
    let whole = format!("{ENTRY_PREFIX}{name}");
    if whole.len() <= LABEL_MAX {
        return whole;
    }
    let hash = name.bytes().fold(0x811c_9dc5u32, |h, b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193));
    // Container names are DNS labels (ASCII): any byte index is a character boundary.
    let keep = &whole[..LABEL_MAX - 9];
    format!("{}-{hash:08x}", keep.trim_end_matches('-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pod from its spec's JSON, as the API server sends it.
    fn pod(spec: Value) -> Pod {
        serde_json::from_value(json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ml"}, "spec": spec}))
            .expect("a pod")
    }

    fn container(name: &str, resources: Value) -> Value {
        json!({"name": name, "image": "registry.example/train:1", "resources": resources})
    }

    fn limits(quantity: &str) -> Value {
        json!({"limits": {RESOURCE: quantity, "cpu": "2"}, "requests": {RESOURCE: quantity, "cpu": "1"}})
    }

    /// The pod after its patch, as JSON.
    fn patched(pod: &Pod, mutation: &Mutation) -> Value {
        let mut doc = serde_json::to_value(pod).expect("json");
        json_patch::patch(&mut doc, &mutation.patch).expect("the patch applies");
        doc
    }

    /// A container's name, its claims' names, and whether it still names the resource.
    type Claimed = (String, Vec<String>, bool);

    /// The pod's claims as (entry, template), and each container's [`Claimed`].
    fn summary(doc: &Value) -> (Vec<(String, String)>, Vec<Claimed>) {
        let claims = doc["spec"]["resourceClaims"]
            .as_array()
            .map(|claims| {
                claims
                    .iter()
                    .map(|c| (c["name"].as_str().unwrap_or("?").to_owned(), c["resourceClaimTemplateName"].as_str().unwrap_or("").to_owned()))
                    .collect()
            })
            .unwrap_or_default();
        let mut containers = Vec::new();
        for list in ["initContainers", "containers"] {
            for c in doc["spec"][list].as_array().into_iter().flatten() {
                let names = c["resources"]["claims"].as_array().into_iter().flatten().map(|n| n["name"].as_str().unwrap_or("?").to_owned()).collect();
                let still = c["resources"]["limits"].get(RESOURCE).is_some() || c["resources"]["requests"].get(RESOURCE).is_some();
                containers.push((c["name"].as_str().unwrap_or("?").to_owned(), names, still));
            }
        }
        (claims, containers)
    }

    fn owned(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect()
    }

    /// `pod`, of one container `main` whose other resources are `cpu: 2` in limits and `1` in
    /// requests, converted: one claim from the template of `shape`, named `template`; the
    /// converted resources gone, the rest as it was.
    fn converted_to_one_claim(pod: &Pod, shape: Shape, template: &str) {
        let mutation = mutate(pod).expect("mutated");
        assert_eq!(mutation.shapes, BTreeSet::from([shape]));
        let doc = patched(pod, &mutation);
        let (claims, containers) = summary(&doc);
        assert_eq!(claims, owned(&[("vramguard-main", template)]));
        assert_eq!(containers, vec![("main".into(), vec!["vramguard-main".into()], false)]);
        assert_eq!(doc["spec"]["containers"][0]["resources"]["limits"], json!({"cpu": "2"}));
        assert_eq!(doc["spec"]["containers"][0]["resources"]["requests"], json!({"cpu": "1"}));
        assert!(mutation.warnings.is_empty());
    }

    #[test]
    fn one_container_gets_a_claim_of_its_size_and_loses_the_resource() {
        let pod = pod(json!({"containers": [container("main", limits("8Gi"))]}));
        converted_to_one_claim(&pod, Shape::one(8 << 30), "vramguard-gpu-memory-8gi");
    }

    #[test]
    fn several_containers_get_a_claim_each_and_sizes_share_templates() {
        let pod = pod(json!({"containers": [
            container("a", limits("8Gi")),
            container("sidecar", json!({"limits": {"cpu": "1"}})),
            container("b", limits("8589934592")),
            container("c", limits("4G")),
        ]}));
        let mutation = mutate(&pod).expect("mutated");
        assert_eq!(mutation.shapes, BTreeSet::from([Shape::one(8 << 30), Shape::one(4_000_000_000)]));
        let (claims, containers) = summary(&patched(&pod, &mutation));
        assert_eq!(
            claims,
            owned(&[
                ("vramguard-a", "vramguard-gpu-memory-8gi"),
                ("vramguard-b", "vramguard-gpu-memory-8gi"),
                ("vramguard-c", "vramguard-gpu-memory-4g"),
            ])
        );
        assert_eq!(containers[1], ("sidecar".into(), vec![], false), "untouched");
        assert!(containers.iter().all(|(_, _, still)| !still));
    }

    #[test]
    fn an_init_container_names_a_main_containers_claim_that_holds_it() {
        let pod = pod(json!({
            "initContainers": [container("warmup", limits("2Gi")), container("plain", json!({}))],
            "containers": [container("main", limits("8Gi"))],
        }));
        let mutation = mutate(&pod).expect("mutated");
        assert_eq!(mutation.shapes, BTreeSet::from([Shape::one(8 << 30)]), "no template for the init container's size");
        let (claims, containers) = summary(&patched(&pod, &mutation));
        assert_eq!(claims, owned(&[("vramguard-main", "vramguard-gpu-memory-8gi")]), "one claim: the max, not the sum");
        assert_eq!(
            containers,
            vec![
                ("warmup".into(), vec!["vramguard-main".into()], false),
                ("plain".into(), vec![], false),
                ("main".into(), vec!["vramguard-main".into()], false)
            ]
        );
    }

    #[test]
    fn init_containers_larger_than_every_main_claim_share_one_of_their_own() {
        // fetch and convert ask more than main: they run one at a time, so one claim of the
        // larger of them; small fits main's claim; main's claim keeps its size.
        let pod = pod(json!({
            "initContainers": [
                container("fetch", limits("12Gi")),
                container("small", limits("1Gi")),
                container("convert", limits("16Gi")),
            ],
            "containers": [container("main", limits("8Gi"))],
        }));
        let mutation = mutate(&pod).expect("mutated");
        let (claims, containers) = summary(&patched(&pod, &mutation));
        assert_eq!(claims, owned(&[("vramguard-convert", "vramguard-gpu-memory-16gi"), ("vramguard-main", "vramguard-gpu-memory-8gi")]));
        let named: Vec<(&str, &str)> = containers.iter().map(|(c, claims, _)| (c.as_str(), claims[0].as_str())).collect();
        assert_eq!(named, vec![("fetch", "vramguard-convert"), ("small", "vramguard-main"), ("convert", "vramguard-convert"), ("main", "vramguard-main")]);
        // Without main containers that ask, the init containers share one claim, the largest's
        // (the first of the largest on a tie).
        let alone = self::pod(json!({
            "initContainers": [container("a", limits("4Gi")), container("b", limits("4Gi")), container("c", limits("2Gi"))],
            "containers": [container("main", json!({}))],
        }));
        let (claims, containers) = summary(&patched(&alone, &mutate(&alone).expect("mutated")));
        assert_eq!(claims, owned(&[("vramguard-a", "vramguard-gpu-memory-4gi")]));
        assert!(containers[..3].iter().all(|(_, claims, _)| claims == &["vramguard-a".to_owned()]), "{containers:?}");
    }

    #[test]
    fn an_init_container_names_the_smallest_main_claim_of_its_gpus_that_holds_it() {
        let gpus = |q: &str, n: &str| json!({"limits": {RESOURCE: q, NVIDIA_GPU: n}});
        let pod = pod(json!({
            "initContainers": [
                container("one", limits("3Gi")),
                container("two", gpus("3Gi", "2")),
                container("four", gpus("1Gi", "4")),
            ],
            "containers": [
                container("big", limits("16Gi")),
                container("pair", gpus("4Gi", "2")),
                container("fits", limits("4Gi")),
                container("also", limits("4Gi")),
                container("small", limits("2Gi")),
            ],
        }));
        let mutation = mutate(&pod).expect("mutated");
        let (claims, containers) = summary(&patched(&pod, &mutation));
        let named: Vec<(&str, &str)> = containers.iter().map(|(c, claims, _)| (c.as_str(), claims[0].as_str())).collect();
        assert_eq!(
            named[..3],
            [("one", "vramguard-fits"), ("two", "vramguard-pair"), ("four", "vramguard-four")],
            "the smallest that holds it, the first of equals; a claim of other GPUs is never shared"
        );
        assert_eq!(claims[0], ("vramguard-four".to_owned(), "vramguard-gpu-memory-1gi-x4".to_owned()));
        assert_eq!(claims.len(), 6, "main containers' claims and one for four: {claims:?}");
    }

    #[test]
    fn sidecars_keep_a_claim_of_their_own() {
        // A sidecar (restartPolicy: Always) runs beside the main containers: never shared, and
        // an ordinary init container does not name its claim either.
        let mut sidecar = container("proxy", limits("2Gi"));
        sidecar["restartPolicy"] = json!("Always");
        let pod = pod(json!({
            "initContainers": [sidecar, container("warmup", limits("2Gi"))],
            "containers": [container("main", limits("8Gi"))],
        }));
        let (claims, containers) = summary(&patched(&pod, &mutate(&pod).expect("mutated")));
        assert_eq!(claims, owned(&[("vramguard-proxy", "vramguard-gpu-memory-2gi"), ("vramguard-main", "vramguard-gpu-memory-8gi")]));
        assert_eq!(containers[0].1, vec!["vramguard-proxy".to_owned()]);
        assert_eq!(containers[1].1, vec!["vramguard-main".to_owned()]);
    }

    #[test]
    fn who_shares_whose_claim() {
        let (main, init, sidecar) = (Role::Main, Role::Init, Role::Sidecar);
        let gib = |n: u64| Shape::one(n << 30);
        assert_eq!(share(&[]), Vec::<usize>::new());
        assert_eq!(share(&[(init, gib(2)), (main, gib(8))]), vec![1, 1]);
        assert_eq!(share(&[(init, gib(8)), (main, gib(8))]), vec![1, 1], "an equal size fits");
        assert_eq!(share(&[(init, gib(9)), (main, gib(8))]), vec![0, 1]);
        assert_eq!(share(&[(init, gib(2)), (sidecar, gib(8)), (main, gib(1))]), vec![0, 1, 2], "never a sidecar's claim");
        assert_eq!(share(&[(init, gib(2)), (init, gib(3)), (init, gib(3))]), vec![1, 1, 1]);
        let two = Shape { bytes: 1 << 30, gpus: 2 };
        assert_eq!(share(&[(init, two), (main, gib(8)), (init, gib(2))]), vec![0, 1, 1], "other GPUs: its own");
    }

    #[test]
    fn limits_alone_and_requests_alone() {
        for resources in [json!({"limits": {RESOURCE: "1536Mi"}}), json!({"requests": {RESOURCE: "1536Mi"}})] {
            let pod = pod(json!({"containers": [container("main", resources.clone())]}));
            let mutation = mutate(&pod).expect("mutated");
            assert_eq!(mutation.shapes, BTreeSet::from([Shape::one(1536 << 20)]), "{resources}");
            let doc = patched(&pod, &mutation);
            let (claims, containers) = summary(&doc);
            assert_eq!(claims, owned(&[("vramguard-main", "vramguard-gpu-memory-1536mi")]));
            assert!(!containers[0].2, "{doc}");
        }
    }

    #[test]
    fn a_pod_without_the_resource_is_untouched() {
        for spec in [
            json!({"containers": [container("main", json!({"limits": {"cpu": "1", "nvidia.com/gpu": "1"}}))]}),
            // nvidia.com/gpu alone is the device plugin's, however many and wherever.
            json!({"containers": [container("main", json!({"limits": {NVIDIA_GPU: "2"}, "requests": {NVIDIA_GPU: "2"}}))],
                   "initContainers": [container("init", json!({"limits": {NVIDIA_GPU: "8"}}))]}),
            json!({"containers": [{"name": "bare", "image": "x"}]}),
            json!({"containers": [container("main", json!({}))], "resourceClaims": [{"name": "mine", "resourceClaimName": "shared"}]}),
        ] {
            let mutation = mutate(&pod(spec.clone())).expect("allowed");
            assert!(mutation.patch.is_empty() && mutation.shapes.is_empty(), "{spec}");
        }
        let no_spec: Pod = serde_json::from_value(json!({"metadata": {"name": "p"}})).expect("pod");
        assert!(mutate(&no_spec).expect("allowed").patch.is_empty());
    }

    #[test]
    fn invalid_quantities_and_mismatches_are_refused_with_the_container_named() {
        for (resources, expected) in [
            (json!({"limits": {RESOURCE: "8GB"}}), r#"container "main": limits.vramguard.io/gpu-memory "8GB" is not a quantity of whole bytes"#),
            (json!({"limits": {RESOURCE: "0.5"}}), r#"limits.vramguard.io/gpu-memory "0.5""#),
            (json!({"limits": {RESOURCE: "-8Gi"}}), r#""-8Gi" is not a quantity"#),
            (json!({"limits": {RESOURCE: "8Gi"}, "requests": {RESOURCE: "lots"}}), r#"requests.vramguard.io/gpu-memory "lots""#),
            (json!({"limits": {RESOURCE: "8Gi"}, "requests": {RESOURCE: "4Gi"}}), "differs from limits"),
        ] {
            let refusal = mutate(&pod(json!({"containers": [container("main", resources.clone())]}))).expect_err("refused");
            assert!(refusal.0.contains(expected), "{resources}: {refusal}");
        }
    }

    #[test]
    fn nvidia_gpu_beside_the_quota_is_the_claims_count_and_is_removed() {
        let pod = pod(json!({"containers": [container(
            "main",
            json!({"limits": {RESOURCE: "8Gi", NVIDIA_GPU: "2", "cpu": "2"}, "requests": {RESOURCE: "8Gi", NVIDIA_GPU: "2", "cpu": "1"}})
        )]}));
        // Neither resource is left for the device plugin; the rest stays.
        converted_to_one_claim(&pod, Shape { bytes: 8 << 30, gpus: 2 }, "vramguard-gpu-memory-8gi-x2");
        // One GPU, in limits alone or in requests alone: the template of one GPU, the resource gone.
        for resources in [json!({"limits": {RESOURCE: "8Gi", NVIDIA_GPU: "1"}}), json!({"limits": {RESOURCE: "8Gi"}, "requests": {NVIDIA_GPU: "1"}})] {
            let pod = self::pod(json!({"containers": [container("main", resources.clone())]}));
            let mutation = mutate(&pod).expect("mutated");
            assert_eq!(mutation.shapes, BTreeSet::from([Shape::one(8 << 30)]), "{resources}");
            let doc = patched(&pod, &mutation);
            assert_eq!(summary(&doc).0, owned(&[("vramguard-main", "vramguard-gpu-memory-8gi")]));
            assert!(!doc.to_string().contains(NVIDIA_GPU), "{doc}");
        }
        // The same size on one and on two GPUs: two templates.
        let both = self::pod(json!({"containers": [
            container("a", json!({"limits": {RESOURCE: "8Gi", NVIDIA_GPU: "2"}})),
            container("b", limits("8Gi")),
            container("c", json!({"limits": {RESOURCE: "8Gi", NVIDIA_GPU: MAX_GPUS.to_string()}})),
        ]}));
        let shapes = mutate(&both).expect("mutated").shapes;
        assert_eq!(shapes, BTreeSet::from([Shape::one(8 << 30), Shape { bytes: 8 << 30, gpus: 2 }, Shape { bytes: 8 << 30, gpus: MAX_GPUS }]));
    }

    #[test]
    fn a_zero_quota_leaves_nvidia_gpu_to_the_device_plugin() {
        let pod = pod(json!({"containers": [container("main", json!({"limits": {RESOURCE: "0", NVIDIA_GPU: "1"}}))]}));
        let mutation = mutate(&pod).expect("allowed");
        assert!(mutation.shapes.is_empty());
        let doc = patched(&pod, &mutation);
        assert_eq!(doc["spec"]["containers"][0]["resources"]["limits"], json!({NVIDIA_GPU: "1"}));
        assert_eq!(mutation.warnings.len(), 1);
    }

    #[test]
    fn gpu_counts_that_cannot_be_converted_are_refused_saying_what_to_write() {
        let with = |gpus: Value| json!({"limits": {RESOURCE: "8Gi", NVIDIA_GPU: gpus}});
        for (resources, expected) in [
            (
                json!({"limits": {RESOURCE: "8Gi", NVIDIA_GPU: "2"}, "requests": {RESOURCE: "8Gi", NVIDIA_GPU: "1"}}),
                r#"container "main": requests.nvidia.com/gpu (1) differs from limits.nvidia.com/gpu (2): write the same number of GPUs in both, or in limits alone"#,
            ),
            (with(json!("0")), r#"container "main": nvidia.com/gpu is 0 but vramguard.io/gpu-memory asks 8Gi on each of its GPUs: write nvidia.com/gpu: 1 or more, or remove vramguard.io/gpu-memory"#),
            (with(json!("1.5")), r#"container "main": limits.nvidia.com/gpu "1.5" is not a whole number of GPUs"#),
            (with(json!("500m")), r#""500m" is not a whole number of GPUs: beside vramguard.io/gpu-memory it is the number of GPUs the quota is on, each with 8Gi (write e.g. nvidia.com/gpu: 2)"#),
            (with(json!("two")), r#""two" is not a whole number of GPUs"#),
            (with(json!("33")), r#"container "main": nvidia.com/gpu 33 is more GPUs than one claim can be given (32, the API's limit on a claim's devices): write 32 or fewer"#),
            (with(json!("1k")), "nvidia.com/gpu 1000 is more GPUs"),
            (with(json!("5000000000")), "nvidia.com/gpu 5000000000 is more GPUs"),
        ] {
            let refusal = mutate(&pod(json!({"containers": [container("main", resources.clone())]}))).expect_err("refused");
            assert!(refusal.0.contains(expected), "{resources}: {refusal}");
        }
        // A count that spells a whole number otherwise is that number.
        let spelled = pod(json!({"containers": [container("main", with(json!("2.0")))]}));
        assert_eq!(mutate(&spelled).expect("mutated").shapes, BTreeSet::from([Shape { bytes: 8 << 30, gpus: 2 }]));
        // An init container's count too, with the container named.
        let init = pod(json!({"initContainers": [container("warmup", with(json!("0")))], "containers": [container("main", limits("8Gi"))]}));
        assert!(mutate(&init).expect_err("refused").0.starts_with(r#"container "warmup": nvidia.com/gpu is 0"#));
    }

    #[test]
    fn existing_claims_are_kept_and_appended_to() {
        let pod = pod(json!({
            "resourceClaims": [{"name": "nic", "resourceClaimTemplateName": "rdma"}],
            "containers": [container("main", json!({"limits": {RESOURCE: "8Gi"}, "claims": [{"name": "nic"}]})), container("two", limits("1Gi"))],
        }));
        let mutation = mutate(&pod).expect("mutated");
        let (claims, containers) = summary(&patched(&pod, &mutation));
        assert_eq!(
            claims,
            owned(&[("nic", "rdma"), ("vramguard-main", "vramguard-gpu-memory-8gi"), ("vramguard-two", "vramguard-gpu-memory-1gi")])
        );
        assert_eq!(containers[0], ("main".into(), vec!["nic".into(), "vramguard-main".into()], false));
        // A claim of the user's with the name vramguard would give: refused, not overwritten.
        let clash = self::pod(json!({
            "resourceClaims": [{"name": "vramguard-main", "resourceClaimName": "theirs"}],
            "containers": [container("main", limits("8Gi"))],
        }));
        assert!(mutate(&clash).expect_err("refused").0.contains("already has a resource claim named \"vramguard-main\""));
    }

    #[test]
    fn zero_is_removed_with_a_warning_and_no_claim() {
        let pod = pod(json!({"containers": [container("main", limits("0"))]}));
        let mutation = mutate(&pod).expect("allowed");
        assert!(mutation.shapes.is_empty());
        let (claims, containers) = summary(&patched(&pod, &mutation));
        assert!(claims.is_empty());
        assert_eq!(containers, vec![("main".into(), vec![], false)]);
        assert_eq!(mutation.warnings.len(), 1, "{:?}", mutation.warnings);
    }

    #[test]
    fn the_patch_is_idempotent() {
        let original = pod(json!({"containers": [container("main", limits("8Gi"))]}));
        let once = patched(&original, &mutate(&original).expect("mutated"));
        let again: Pod = serde_json::from_value(once).expect("pod");
        assert!(mutate(&again).expect("allowed").patch.is_empty(), "nothing left to convert");
    }

    #[test]
    fn names() {
        assert_eq!(quantity_text(8 << 30), "8Gi");
        assert_eq!(quantity_text(8_000_000_000), "8G");
        assert_eq!(quantity_text(1536 << 20), "1536Mi");
        assert_eq!(quantity_text(1024), "1Ki");
        assert_eq!(quantity_text(1000), "1k");
        assert_eq!(quantity_text(1_000_001), "1000001");
        assert_eq!(quantity_text(u64::MAX), u64::MAX.to_string());
        assert_eq!(template_name(Shape::one(80 << 30)), "vramguard-gpu-memory-80gi");
        assert_eq!(template_name(Shape { bytes: 8 << 30, gpus: 2 }), "vramguard-gpu-memory-8gi-x2");
        assert_eq!(template_name(Shape { bytes: 1_000_001, gpus: MAX_GPUS }), "vramguard-gpu-memory-1000001-x32");
        assert_eq!(template_name(Shape::one(u64::MAX)).len(), TEMPLATE_PREFIX.len() + 20);
        // The longest name is far within a name's 253 characters.
        assert!(template_name(Shape { bytes: u64::MAX, gpus: MAX_GPUS }).len() < 63);
        assert_eq!(Shape::one(8 << 30).to_string(), "8Gi");
        assert_eq!(Shape { bytes: 8 << 30, gpus: 2 }.to_string(), "8Gi x2");
        for bytes in [1, 999, 1 << 20, 3 << 29, 8_000_000_000, 15 << 60, u64::MAX] {
            assert_eq!(parse_quantity(&quantity_text(bytes)), Some(bytes), "{bytes}");
        }
        assert_eq!(claim_entry("main"), "vramguard-main");
        let long = "a".repeat(63);
        let entry = claim_entry(&long);
        assert!(entry.len() <= LABEL_MAX && entry.starts_with("vramguard-aaa"), "{entry}");
        assert_ne!(entry, claim_entry(&format!("{}b", "a".repeat(62))), "the hash tells them apart");
        assert_eq!(claim_entry(&"a".repeat(53)).len(), 63);
    }
}
