//! The mock API server's resource.k8s.io/v1: ResourceClaims as the scheduler left them
//! (allocated, reserved), the DRA driver's ResourceSlices (list, watch, create, update, delete,
//! with the `spec.nodeName` and `spec.driver` field selectors), DeviceClasses.
use std::collections::{BTreeMap, HashMap};

use serde_json::Value;

use super::{status, Answer, ApiState};
#[allow(unused_imports)]
use super::answer;
use hyper::StatusCode;

/// What the server holds of resource.k8s.io/v1.
#[derive(Default)]
pub struct Resources {
    /// ResourceClaims by (namespace, name).
    pub claims: BTreeMap<(String, String), Value>,
    /// ResourceSlices by name.
    pub slices: BTreeMap<String, Value>,
    /// DeviceClasses by name.
    pub classes: BTreeMap<String, Value>,
}

/// A request under `/apis/resource.k8s.io/v1/`: its method, the path's segments after the
/// version, the query's pairs and the body.
pub struct Asked<'a> {
    pub method: &'a str,
    pub rest: &'a [&'a str],
    pub query: &'a HashMap<&'a str, &'a str>,
    pub body: &'a str,
}

/// The answer to a resource.k8s.io/v1 request; `None`: not found.
pub fn serve(state: &mut ApiState, asked: Asked<'_>) -> Option<Answer> {
    match asked.rest {
        ["namespaces", _, "resourceclaims", ..] | ["resourceclaims", ..] => claims(state, &asked),
        ["resourceslices", ..] => slices(state, &asked),
        _ => Some(status(StatusCode::NOT_FOUND, "NotFound", "the server could not find the requested resource")),
    }
}

/// ResourceClaims: a GET of a namespaced one, as the DRA driver's prepare asks it.
fn claims(state: &mut ApiState, asked: &Asked<'_>) -> Option<Answer> {
    match (asked.method, asked.rest) {
        ("GET", ["namespaces", namespace, "resourceclaims", name]) => {
            Some(match state.resource.claims.get(&((*namespace).to_owned(), (*name).to_owned())) {
                Some(claim) => answer(StatusCode::OK, claim),
                None => status(StatusCode::NOT_FOUND, "NotFound", &format!("resourceclaims.resource.k8s.io \"{name}\" not found")),
            })
        }
        _ => Some(status(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", "this server serves a GET of a namespaced ResourceClaim")),
    }
}

/// An allocation result: `(driver, pool, device, consumedCapacity.memory, shareID)`.
pub type Allocated<'a> = (&'a str, &'a str, &'a str, Option<&'a str>, &'a str);

/// A ResourceClaim as the API server writes it once the scheduler allocated it: one request
/// `gpu` of the driver's class asking `memory`, and, with `results`, `status.allocation` and
/// `reservedFor` a pod.
pub fn claim(namespace: &str, name: &str, uid: &str, memory: &str, results: Option<&[Allocated<'_>]>) -> Value {
    let mut claim = serde_json::json!({
        "kind": "ResourceClaim", "apiVersion": "resource.k8s.io/v1",
        "metadata": {"name": name, "namespace": namespace, "uid": uid, "resourceVersion": "200", "creationTimestamp": "2026-11-27T10:00:00Z"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "gpu.vramguard.io", "allocationMode": "ExactCount", "count": 1,
            "capacity": {"requests": {"memory": memory}}
        }}]}},
        "status": {}
    });
    if let Some(results) = results {
        let results: Vec<Value> = results
            .iter()
            .map(|(driver, pool, device, consumed, share)| {
                let mut result = serde_json::json!({"request": "gpu", "driver": driver, "pool": pool, "device": device, "shareID": share});
                if let Some(consumed) = consumed {
                    result["consumedCapacity"] = serde_json::json!({"memory": consumed});
                }
                result
            })
            .collect();
        claim["status"] = serde_json::json!({
            "allocation": {"devices": {"results": results}, "allocationTimestamp": "2026-11-27T10:00:01Z"},
            "reservedFor": [{"resource": "pods", "name": format!("{name}-pod"), "uid": format!("{uid}-pod")}]
        });
    }
    claim
}

impl super::ApiServer {
    /// Puts a ResourceClaim in the server (replacing one of the same namespace and name).
    pub fn put_claim(&self, claim: Value) {
        let key = (claim["metadata"]["namespace"].as_str().unwrap_or_default().to_owned(), claim["metadata"]["name"].as_str().unwrap_or_default().to_owned());
        self.with(|s| s.resource.claims.insert(key, claim));
    }

    /// Removes a ResourceClaim from the server.
    pub fn delete_claim(&self, namespace: &str, name: &str) {
        self.with(|s| s.resource.claims.remove(&(namespace.to_owned(), name.to_owned())));
    }
}

/// ResourceSlices.
fn slices(_state: &mut ApiState, _asked: &Asked<'_>) -> Option<Answer> {
    None
}
