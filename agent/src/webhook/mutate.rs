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
//!   named; zero removes the resource and adds no claim (a warning says so);
//! * the resource is removed from its limits and requests;
//! * a pod claim of its own, `vramguard-<container>` (see [`claim_entry`]), from the
//!   namespace's template for that size ([`template_name`]), named in its
//!   `resources.claims`: every container gets its own claim, as every container had its own
//!   quota; two containers asking the same size share the template, never the claim.
//!
//! A pod with no container asking gets no patch at all. The mutation is idempotent: once
//! applied, the pod asks for nothing, so a second call (`reinvocationPolicy: IfNeeded`)
//! leaves it alone.
use std::collections::{BTreeMap, BTreeSet};

use json_patch::{
    jsonptr::{PointerBuf, Token},
    AddOperation, Patch, PatchOperation, RemoveOperation,
};
use k8s_openapi::api::core::v1::{Container, Pod};
use serde_json::{json, Value};

use crate::provision::kube::{parse_quantity, RESOURCE};

/// The prefix of the ResourceClaimTemplates the webhook writes, one per size in a namespace.
pub const TEMPLATE_PREFIX: &str = "vramguard-gpu-memory-";
/// The prefix of the pod claims the webhook adds, one per container that asked.
pub const ENTRY_PREFIX: &str = "vramguard-";
/// The longest pod claim name (a DNS label).
const LABEL_MAX: usize = 63;

/// What a pod needs: the sizes of the templates it names, and its patch. `patch` is empty for
/// a pod that asks for nothing.
#[derive(Debug, Default)]
pub struct Mutation {
    /// The distinct sizes, in bytes, the pod's claims are made from.
    pub sizes: BTreeSet<u64>,
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

/// The pod's mutation: see the module's docs.
pub fn mutate(pod: &Pod) -> Result<Mutation, Refusal> {
    let mut mutation = Mutation::default();
    let Some(spec) = pod.spec.as_ref() else { return Ok(mutation) };
    let mut taken: BTreeSet<String> = spec.resource_claims.iter().flatten().map(|c| c.name.clone()).collect();
    let mut entries = Vec::new();
    let lists = [(List::Init, spec.init_containers.as_deref().unwrap_or_default()), (List::Main, spec.containers.as_slice())];
    for (list, containers) in lists {
        for (index, container) in containers.iter().enumerate() {
            let Some(asked) = asked(container)? else { continue };
            let base = container_path(list, index);
            let resources = base.with_trailing_token("resources");
            if asked.in_limits {
                mutation.patch.push(remove(resources.with_trailing_token("limits").with_trailing_token(RESOURCE)));
            }
            if asked.in_requests {
                mutation.patch.push(remove(resources.with_trailing_token("requests").with_trailing_token(RESOURCE)));
            }
            if asked.bytes == 0 {
                mutation.warnings.push(format!("container {:?}: {RESOURCE} of 0 removed: no GPU memory claimed", container.name));
                continue;
            }
            let entry = claim_entry(&container.name);
            if !taken.insert(entry.clone()) {
                return Err(Refusal(format!(
                    "container {:?}: the pod already has a resource claim named {entry:?}, the name vramguard gives the claim that replaces its {RESOURCE}",
                    container.name
                )));
            }
            let claim = json!({"name": entry});
            match container.resources.as_ref().and_then(|r| r.claims.as_ref()) {
                Some(_) => mutation.patch.push(add(resources.with_trailing_token("claims").with_trailing_token("-"), claim)),
                None => mutation.patch.push(add(resources.with_trailing_token("claims"), json!([claim]))),
            }
            entries.push(json!({"name": entry, "resourceClaimTemplateName": template_name(asked.bytes)}));
            mutation.sizes.insert(asked.bytes);
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

/// What a container asked for.
struct Asked {
    bytes: u64,
    in_limits: bool,
    in_requests: bool,
}

/// The container's `vramguard.io/gpu-memory`, checked; `None` if it asks for none.
fn asked(container: &Container) -> Result<Option<Asked>, Refusal> {
    let Some(resources) = container.resources.as_ref() else { return Ok(None) };
    let quantity = |map: &Option<BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>, what: &str| {
        map.as_ref()
            .and_then(|m| m.get(RESOURCE))
            .map(|q| {
                parse_quantity(&q.0).ok_or_else(|| {
                    Refusal(format!(
                        "container {:?}: {what}.{RESOURCE} {:?} is not a quantity of whole bytes (e.g. 8Gi, 8192Mi, 8589934592)",
                        container.name, q.0
                    ))
                })
            })
            .transpose()
    };
    let limit = quantity(&resources.limits, "limits")?;
    let request = quantity(&resources.requests, "requests")?;
    let bytes = match (limit, request) {
        (None, None) => return Ok(None),
        (Some(limit), Some(request)) if limit != request => {
            return Err(Refusal(format!(
                "container {:?}: requests.{RESOURCE} ({request} bytes) differs from limits.{RESOURCE} ({limit} bytes): they must be equal",
                container.name
            )))
        }
        (Some(bytes), _) | (None, Some(bytes)) => bytes,
    };
    Ok(Some(Asked { bytes, in_limits: limit.is_some(), in_requests: request.is_some() }))
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

/// The namespace's template for `bytes`: `vramguard-gpu-memory-8gi` (the quantity's shortest
/// spelling, lowercase: `8g` is 8 GB, `8gi` 8 GiB).
pub fn template_name(bytes: u64) -> String {
    format!("{TEMPLATE_PREFIX}{}", quantity_text(bytes).to_ascii_lowercase())
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

    #[test]
    fn one_container_gets_a_claim_of_its_size_and_loses_the_resource() {
        let pod = pod(json!({"containers": [container("main", limits("8Gi"))]}));
        let mutation = mutate(&pod).expect("mutated");
        assert_eq!(mutation.sizes, BTreeSet::from([8u64 << 30]));
        let doc = patched(&pod, &mutation);
        let (claims, containers) = summary(&doc);
        assert_eq!(claims, owned(&[("vramguard-main", "vramguard-gpu-memory-8gi")]));
        assert_eq!(containers, vec![("main".into(), vec!["vramguard-main".into()], false)]);
        // The rest of the resources stay as they were.
        assert_eq!(doc["spec"]["containers"][0]["resources"]["limits"], json!({"cpu": "2"}));
        assert_eq!(doc["spec"]["containers"][0]["resources"]["requests"], json!({"cpu": "1"}));
        assert!(mutation.warnings.is_empty());
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
        assert_eq!(mutation.sizes, BTreeSet::from([8u64 << 30, 4_000_000_000]));
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
    fn init_containers_too() {
        let pod = pod(json!({
            "initContainers": [container("warmup", limits("2Gi")), container("plain", json!({}))],
            "containers": [container("main", limits("8Gi"))],
        }));
        let mutation = mutate(&pod).expect("mutated");
        let (claims, containers) = summary(&patched(&pod, &mutation));
        assert_eq!(claims, owned(&[("vramguard-warmup", "vramguard-gpu-memory-2gi"), ("vramguard-main", "vramguard-gpu-memory-8gi")]));
        assert_eq!(
            containers,
            vec![
                ("warmup".into(), vec!["vramguard-warmup".into()], false),
                ("plain".into(), vec![], false),
                ("main".into(), vec!["vramguard-main".into()], false)
            ]
        );
    }

    #[test]
    fn limits_alone_and_requests_alone() {
        for resources in [json!({"limits": {RESOURCE: "1536Mi"}}), json!({"requests": {RESOURCE: "1536Mi"}})] {
            let pod = pod(json!({"containers": [container("main", resources.clone())]}));
            let mutation = mutate(&pod).expect("mutated");
            assert_eq!(mutation.sizes, BTreeSet::from([1536u64 << 20]), "{resources}");
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
            json!({"containers": [{"name": "bare", "image": "x"}]}),
            json!({"containers": [container("main", json!({}))], "resourceClaims": [{"name": "mine", "resourceClaimName": "shared"}]}),
        ] {
            let mutation = mutate(&pod(spec.clone())).expect("allowed");
            assert!(mutation.patch.is_empty() && mutation.sizes.is_empty(), "{spec}");
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
        assert!(mutation.sizes.is_empty());
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
        assert_eq!(template_name(80 << 30), "vramguard-gpu-memory-80gi");
        assert_eq!(template_name(u64::MAX).len(), TEMPLATE_PREFIX.len() + 20);
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
