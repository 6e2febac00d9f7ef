//! The mock API server's ResourceClaimTemplates (resource.k8s.io/v1, namespaced): `GET` of
//! one and `POST` (create; `409 AlreadyExists` when the name is taken), checked as the real
//! server checks what the admission webhook writes: the kind and version, the name, the
//! namespace (the path's, or none), each request naming a DeviceClass, and admin access only
//! in a namespace labelled for it ([`super::resource::admin_access_forbidden`]).
use serde_json::{json, Value};
use hyper::StatusCode;

use super::{answer, status, Answer, ApiState};

/// A request under `/apis/resource.k8s.io/v1/namespaces/<namespace>/resourceclaimtemplates`.
pub fn serve(state: &mut ApiState, method: &str, namespace: &str, rest: &[&str], body: &str) -> Answer {
    match (method, rest) {
        ("GET", [name]) => match state.templates.get(&(namespace.to_owned(), (*name).to_owned())) {
            Some(template) => answer(StatusCode::OK, template),
            None => status(StatusCode::NOT_FOUND, "NotFound", &format!("resourceclaimtemplates.resource.k8s.io \"{name}\" not found")),
        },
        ("POST", []) => create(state, namespace, body),
        _ => status(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", "only GET of one and POST here"),
    }
}

fn create(state: &mut ApiState, namespace: &str, body: &str) -> Answer {
    let Ok(mut template) = serde_json::from_str::<Value>(body) else {
        return status(StatusCode::BAD_REQUEST, "BadRequest", "not JSON");
    };
    if let Some(why) = invalid(&template, namespace) {
        return status(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", &why);
    }
    if let Some(why) = super::resource::admin_access_forbidden(&state.resource, namespace, &template["spec"]["spec"]["devices"]["requests"], "spec.spec.devices.requests") {
        return status(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", &why);
    }
    let name = template["metadata"]["name"].as_str().unwrap_or_default().to_owned();
    let key = (namespace.to_owned(), name.clone());
    if state.templates.contains_key(&key) {
        return status(StatusCode::CONFLICT, "AlreadyExists", &format!("resourceclaimtemplates.resource.k8s.io \"{name}\" already exists"));
    }
    state.version += 1;
    let metadata = &mut template["metadata"];
    metadata["namespace"] = json!(namespace);
    metadata["uid"] = json!(format!("7e3a1c00-0000-4000-8000-{:012}", state.version));
    metadata["resourceVersion"] = json!(state.version.to_string());
    metadata["creationTimestamp"] = json!("2026-11-27T19:00:00Z");
    state.templates.insert(key, template.clone());
    answer(StatusCode::CREATED, &template)
}

/// Why the real server would refuse `template` in `namespace`.
fn invalid(template: &Value, namespace: &str) -> Option<String> {
    if template["apiVersion"] != "resource.k8s.io/v1" || template["kind"] != "ResourceClaimTemplate" {
        return Some(format!("apiVersion {} kind {}", template["apiVersion"], template["kind"]));
    }
    if !template["metadata"]["name"].as_str().is_some_and(|n| !n.is_empty() && n.len() <= 253) {
        return Some("metadata.name: Required value".into());
    }
    if template["metadata"]["namespace"].as_str().is_some_and(|n| n != namespace) {
        return Some("metadata.namespace: does not match the namespace of the request".into());
    }
    let requests = template["spec"]["spec"]["devices"]["requests"].as_array()?;
    for (i, request) in requests.iter().enumerate() {
        let missing = |value: &Value| value.as_str().is_none_or(str::is_empty);
        if missing(&request["name"]) || missing(&request["exactly"]["deviceClassName"]) {
            return Some(format!("spec.spec.devices.requests[{i}]: a name and exactly.deviceClassName are required"));
        }
    }
    None
}
