//! The mock API server's resource.k8s.io/v1: ResourceClaims as the scheduler left them
//! (allocated, reserved), the DRA driver's ResourceSlices (list, watch, create, update, delete,
//! with the `spec.nodeName` and `spec.driver` field selectors), DeviceClasses.
use std::collections::{BTreeMap, HashMap};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::{header::CONTENT_TYPE, Response};
use serde_json::{json, Value};
use tokio::sync::mpsc;

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
    /// The watches of ResourceSlices, with their field selectors.
    pub slice_watches: Vec<(Selector, mpsc::UnboundedSender<Bytes>)>,
    /// `DRAConsumableCapacity` off, as in the API servers of Kubernetes 1.34 and 1.35 by
    /// default ([`drop_gated`]).
    pub gate_off: bool,
    /// The labels of each namespace (a namespace not here has none): what the admin-access
    /// check reads ([`admin_access_forbidden`]).
    pub namespace_labels: BTreeMap<String, Value>,
}

/// The label a namespace needs for claims and claim templates with admin access in it
/// (KEP-5018; `DRAAdminAccess`, on by default from Kubernetes 1.34).
pub const ADMIN_ACCESS_LABEL: &str = "resource.kubernetes.io/admin-access";

/// Why the API server refuses `requests` (a claim's `spec.devices.requests`, at `path`) in
/// `namespace`: a request with `exactly.adminAccess: true` where the namespace is not labelled
/// [`ADMIN_ACCESS_LABEL`]`: "true"` (the value compared as written). The message is the API
/// server's field error.
pub fn admin_access_forbidden(resources: &Resources, namespace: &str, requests: &Value, path: &str) -> Option<String> {
    let allowed = resources.namespace_labels.get(namespace).is_some_and(|labels| labels[ADMIN_ACCESS_LABEL] == "true");
    let requests = requests.as_array()?;
    let (i, _) = requests.iter().enumerate().find(|(_, r)| r["exactly"]["adminAccess"] == true).filter(|_| !allowed)?;
    Some(format!("{path}[{i}].exactly.adminAccess: Forbidden: admin access to devices requires the `{ADMIN_ACCESS_LABEL}: true` label on the containing namespace"))
}

/// Whether `object` (a ResourceSlice or a ResourceClaim) uses a field `DRAConsumableCapacity`
/// guards: the API server with the gate off keeps such fields on an update of an object that
/// already uses them (the registry's rule for a disabled field: drop it only where the old
/// object does not use it).
pub fn uses_gated(object: &Value) -> bool {
    let devices = object["spec"]["devices"].as_array().into_iter().flatten();
    let slice = devices.clone().any(|d| d["allowMultipleAllocations"] == true || d["capacity"].as_object().is_some_and(|c| c.values().any(|v| !v["requestPolicy"].is_null())));
    let requests = object["spec"]["devices"]["requests"].as_array().into_iter().flatten().any(|r| !r["exactly"]["capacity"].is_null());
    let results = object["status"]["allocation"]["devices"]["results"].as_array().into_iter().flatten().any(|r| !r["consumedCapacity"].is_null() || !r["shareID"].is_null());
    slice || requests || results
}

/// What an API server whose `DRAConsumableCapacity` gate is off does to what it is given to
/// store where the stored object did not use the gated fields ([`uses_gated`]): a
/// ResourceSlice's devices lose `allowMultipleAllocations` and their capacities'
/// `requestPolicy`; a ResourceClaim's requests lose `capacity`, its allocation results
/// `consumedCapacity` and `shareID`.
pub fn drop_gated(object: &mut Value) {
    let each = |list: &mut Value, fields: &[&str]| {
        for item in list.as_array_mut().into_iter().flatten() {
            if let Some(item) = item.as_object_mut() {
                for field in fields {
                    item.remove(*field);
                }
            }
        }
    };
    match object["kind"].as_str() {
        Some("ResourceSlice") => {
            for device in object["spec"]["devices"].as_array_mut().into_iter().flatten() {
                if let Some(device) = device.as_object_mut() {
                    device.remove("allowMultipleAllocations");
                }
                for capacity in device["capacity"].as_object_mut().into_iter().flat_map(|c| c.values_mut()) {
                    if let Some(capacity) = capacity.as_object_mut() {
                        capacity.remove("requestPolicy");
                    }
                }
            }
        }
        Some("ResourceClaim") => {
            for request in object["spec"]["devices"]["requests"].as_array_mut().into_iter().flatten() {
                if let Some(exactly) = request["exactly"].as_object_mut() {
                    exactly.remove("capacity");
                }
                for sub in request["firstAvailable"].as_array_mut().into_iter().flatten() {
                    if let Some(sub) = sub.as_object_mut() {
                        sub.remove("capacity");
                    }
                }
            }
            each(&mut object["status"]["allocation"]["devices"]["results"], &["consumedCapacity", "shareID"]);
        }
        _ => {}
    }
}

/// A field selector's terms: (field, value) pairs that must all match.
pub type Selector = Vec<(String, String)>;

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
    pub fn put_claim(&self, mut claim: Value) {
        let key = (claim["metadata"]["namespace"].as_str().unwrap_or_default().to_owned(), claim["metadata"]["name"].as_str().unwrap_or_default().to_owned());
        self.with(|s| {
            if s.resource.gate_off && !s.resource.claims.get(&key).is_some_and(uses_gated) {
                drop_gated(&mut claim);
            }
            s.resource.claims.insert(key, claim)
        });
    }

    /// Creates a ResourceClaim as a client does (its `status` left as given, for the tests'
    /// scheduler to fill later), validated as the API server validates one: a request with
    /// admin access in a namespace without [`ADMIN_ACCESS_LABEL`] is refused (`422 Invalid`,
    /// the API server's message), nothing stored.
    pub fn create_claim(&self, claim: Value) -> Result<(), String> {
        let (namespace, name) = (claim["metadata"]["namespace"].as_str().unwrap_or_default().to_owned(), claim["metadata"]["name"].as_str().unwrap_or_default().to_owned());
        if let Some(why) = self.with(|s| admin_access_forbidden(&s.resource, &namespace, &claim["spec"]["devices"]["requests"], "spec.devices.requests")) {
            return Err(format!("ResourceClaim.resource.k8s.io {name:?} is invalid: {why}"));
        }
        self.put_claim(claim);
        Ok(())
    }

    /// Sets namespace `namespace`'s labels.
    pub fn label_namespace(&self, namespace: &str, labels: Value) {
        self.with(|s| s.resource.namespace_labels.insert(namespace.to_owned(), labels));
    }

    /// Turns `DRAConsumableCapacity` off (as 1.34 and 1.35 ship) or on.
    pub fn set_consumable_capacity(&self, on: bool) {
        self.with(|s| s.resource.gate_off = !on);
    }

    /// Removes a ResourceClaim from the server.
    pub fn delete_claim(&self, namespace: &str, name: &str) {
        self.with(|s| s.resource.claims.remove(&(namespace.to_owned(), name.to_owned())));
    }
}

/// ResourceSlices, as the real server keeps them (cluster-scoped): a list and a watch with
/// the `spec.nodeName` and `spec.driver` field selectors, a create (409 if the name is taken;
/// with `dryRun=All` answered and not stored),
/// an update (`PUT`: 404 if absent, 409 on a stale `resourceVersion`), a delete; each write
/// validated as resource.k8s.io/v1 validates a slice (a name, the driver, the pool, exactly one
/// of the node fields, at most 128 devices, a request policy only on a device that allows
/// multiple allocations), stamped with a new `resourceVersion` and told to the watches.
fn slices(state: &mut ApiState, asked: &Asked<'_>) -> Option<Answer> {
    let selector = match selector(asked.query) {
        Ok(selector) => selector,
        Err(message) => return Some(status(StatusCode::BAD_REQUEST, "BadRequest", &message)),
    };
    let version = state.version.to_string();
    Some(match (asked.method, asked.rest) {
        ("GET", ["resourceslices"]) if asked.query.get("watch") == Some(&"true") => {
            let (sender, receiver) = mpsc::unbounded_channel();
            let since: u64 = asked.query.get("resourceVersion").and_then(|v| v.parse().ok()).unwrap_or(u64::MAX);
            for slice in state.resource.slices.values().filter(|s| selected(&selector, s)) {
                if resource_version(slice) > since {
                    let _ = sender.send(event("ADDED", slice));
                }
            }
            let bookmark = json!({"type": "BOOKMARK", "object": {"kind": "ResourceSlice", "apiVersion": "resource.k8s.io/v1", "metadata": {"resourceVersion": version}}});
            let _ = sender.send(Bytes::from(format!("{bookmark}\n")));
            state.resource.slice_watches.push((selector, sender));
            Response::builder().header(CONTENT_TYPE, "application/json").body(super::Events(receiver).boxed()).expect("a response")
        }
        ("GET", ["resourceslices"]) => {
            let items: Vec<Value> = state.resource.slices.values().filter(|s| selected(&selector, s)).cloned().collect();
            answer(StatusCode::OK, &json!({"kind": "ResourceSliceList", "apiVersion": "resource.k8s.io/v1", "metadata": {"resourceVersion": version}, "items": items}))
        }
        ("GET", ["resourceslices", name]) => match state.resource.slices.get(*name) {
            Some(slice) => answer(StatusCode::OK, slice),
            None => not_found(name),
        },
        ("POST", ["resourceslices"]) => {
            let mut slice = match valid_slice(asked.body, None, state.resource.gate_off) {
                Ok(slice) => slice,
                Err(answer) => return Some(*answer),
            };
            let name = slice["metadata"]["name"].as_str().unwrap_or_default().to_owned();
            if state.resource.slices.contains_key(&name) {
                return Some(status(StatusCode::CONFLICT, "AlreadyExists", &format!("resourceslices.resource.k8s.io \"{name}\" already exists")));
            }
            // `dryRun=All`: validated, its gated fields dropped and answered as a create would
            // be, nothing stored or told.
            if asked.query.get("dryRun") == Some(&"All") {
                return Some(answer(StatusCode::CREATED, &slice));
            }
            state.version += 1;
            slice["metadata"]["resourceVersion"] = json!(state.version.to_string());
            slice["metadata"]["uid"] = json!(format!("slice-uid-{}", state.version));
            slice["metadata"]["creationTimestamp"] = json!("2026-11-27T12:00:00Z");
            tell(state, "ADDED", &slice);
            state.resource.slices.insert(name, slice.clone());
            answer(StatusCode::CREATED, &slice)
        }
        ("PUT", ["resourceslices", name]) => {
            // An update keeps the gated fields of a slice that uses them already.
            let keeps = state.resource.slices.get(*name).is_some_and(uses_gated);
            let mut slice = match valid_slice(asked.body, Some(name), state.resource.gate_off && !keeps) {
                Ok(slice) => slice,
                Err(answer) => return Some(*answer),
            };
            let Some(existing) = state.resource.slices.get(*name) else { return Some(not_found(name)) };
            let asked_version = slice["metadata"]["resourceVersion"].as_str().filter(|v| !v.is_empty());
            if asked_version.is_some_and(|v| Some(v) != existing["metadata"]["resourceVersion"].as_str()) {
                let message = format!("Operation cannot be fulfilled on resourceslices.resource.k8s.io \"{name}\": the object has been modified; please apply your changes to the latest version and try again");
                return Some(status(StatusCode::CONFLICT, "Conflict", &message));
            }
            state.version += 1;
            slice["metadata"]["resourceVersion"] = json!(state.version.to_string());
            slice["metadata"]["uid"] = existing["metadata"]["uid"].clone();
            slice["metadata"]["creationTimestamp"] = existing["metadata"]["creationTimestamp"].clone();
            tell(state, "MODIFIED", &slice);
            state.resource.slices.insert((*name).to_owned(), slice.clone());
            answer(StatusCode::OK, &slice)
        }
        ("DELETE", ["resourceslices", name]) => match state.resource.slices.remove(*name) {
            Some(slice) => {
                state.version += 1;
                tell(state, "DELETED", &slice);
                answer(StatusCode::OK, &slice)
            }
            None => not_found(name),
        },
        _ => status(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", "not served here"),
    })
}

fn not_found(name: &str) -> Answer {
    status(StatusCode::NOT_FOUND, "NotFound", &format!("resourceslices.resource.k8s.io \"{name}\" not found"))
}

/// The `fieldSelector`'s terms (`spec.nodeName`, `spec.driver`, `metadata.name`: the fields
/// the real server selects slices by).
fn selector(query: &HashMap<&str, &str>) -> Result<Selector, String> {
    let Some(raw) = query.get("fieldSelector") else { return Ok(Vec::new()) };
    let decoded = raw.replace("%3D", "=").replace("%3d", "=").replace("%2C", ",").replace("%2c", ",");
    decoded
        .split(',')
        .filter(|t| !t.is_empty())
        .map(|term| {
            let (field, value) = term.split_once('=').ok_or_else(|| format!("invalid field selector term {term:?}"))?;
            let value = value.trim_start_matches('=');
            match field {
                "spec.nodeName" | "spec.driver" | "metadata.name" => Ok((field.to_owned(), value.to_owned())),
                _ => Err(format!("field label not supported: {field}")),
            }
        })
        .collect()
}

fn selected(selector: &[(String, String)], slice: &Value) -> bool {
    selector.iter().all(|(field, value)| {
        let got = match field.as_str() {
            "spec.nodeName" => &slice["spec"]["nodeName"],
            "spec.driver" => &slice["spec"]["driver"],
            _ => &slice["metadata"]["name"],
        };
        got.as_str().unwrap_or_default() == value
    })
}

fn resource_version(object: &Value) -> u64 {
    object["metadata"]["resourceVersion"].as_str().and_then(|v| v.parse().ok()).unwrap_or(0)
}

fn event(kind: &str, object: &Value) -> Bytes {
    Bytes::from(format!("{}\n", json!({"type": kind, "object": object})))
}

/// Sends the event to the watches that select the slice.
fn tell(state: &mut ApiState, kind: &str, slice: &Value) {
    let line = event(kind, slice);
    state.resource.slice_watches.retain(|(selector, watch)| !selected(selector, slice) || watch.send(line.clone()).is_ok());
}

/// The body of a create or update, checked as the real server validates a ResourceSlice
/// (the fields this driver's slices use), or the 400/422 it answers; with the gate off, the
/// gated fields dropped first (the real server drops them before it validates).
fn valid_slice(body: &str, name: Option<&str>, gate_off: bool) -> Result<Value, Box<Answer>> {
    let invalid = |why: &str| status(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", &format!("ResourceSlice is invalid: {why}"));
    let mut slice: Value = serde_json::from_str(body).map_err(|e| Box::new(status(StatusCode::BAD_REQUEST, "BadRequest", &format!("not JSON: {e}"))))?;
    if slice["apiVersion"] != "resource.k8s.io/v1" || slice["kind"] != "ResourceSlice" {
        return Err(Box::new(status(StatusCode::BAD_REQUEST, "BadRequest", "expected apiVersion resource.k8s.io/v1, kind ResourceSlice")));
    }
    let Some(own) = slice["metadata"]["name"].as_str().filter(|n| !n.is_empty()) else { return Err(Box::new(invalid("metadata.name: Required value"))) };
    if name.is_some_and(|name| name != own) {
        return Err(Box::new(status(StatusCode::BAD_REQUEST, "BadRequest", "the name in the body does not match the path")));
    }
    if gate_off {
        drop_gated(&mut slice);
    }
    let spec = &slice["spec"];
    if spec["driver"].as_str().is_none_or(str::is_empty) {
        return Err(Box::new(invalid("spec.driver: Required value")));
    }
    let pool = &spec["pool"];
    if pool["name"].as_str().is_none_or(str::is_empty) || !pool["generation"].is_i64() || pool["resourceSliceCount"].as_i64().is_none_or(|c| c < 1) {
        return Err(Box::new(invalid("spec.pool: name, generation and resourceSliceCount (at least 1) are required")));
    }
    let node_fields = ["nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection"].iter().filter(|f| !spec[**f].is_null()).count();
    if node_fields != 1 {
        return Err(Box::new(invalid("spec: exactly one of nodeName, nodeSelector, allNodes, perDeviceNodeSelection is required")));
    }
    let devices = spec["devices"].as_array().cloned().unwrap_or_default();
    if devices.len() > 128 {
        return Err(Box::new(invalid("spec.devices: Too many: must have at most 128 items")));
    }
    for device in &devices {
        if device["name"].as_str().is_none_or(str::is_empty) {
            return Err(Box::new(invalid("spec.devices[].name: Required value")));
        }
        let policies = device["capacity"].as_object().is_some_and(|c| c.values().any(|v| !v["requestPolicy"].is_null()));
        if policies && device["allowMultipleAllocations"] != true {
            return Err(Box::new(invalid("spec.devices[].capacity[].requestPolicy: only with allowMultipleAllocations")));
        }
    }
    // The server's own metadata is the server's to set.
    for field in ["uid", "creationTimestamp"] {
        if let Some(metadata) = slice["metadata"].as_object_mut() {
            metadata.remove(field);
        }
    }
    Ok(slice)
}
