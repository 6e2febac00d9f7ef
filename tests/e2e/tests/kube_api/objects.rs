//! The mock API server's Secrets (core v1, namespaced) and MutatingWebhookConfigurations
//! (admissionregistration.k8s.io/v1, cluster-scoped), kept as the real server keeps any object:
//! `GET` of one (404 when absent), `POST` (201; `409 AlreadyExists` when the name is taken),
//! `PUT` (404 when absent; `409 Conflict` when the body's `resourceVersion` is not the stored
//! one; a Secret's `type` is immutable: 422), `PATCH` by a JSON patch (422 when it does not
//! apply; `409` when it sets a `resourceVersion` that is not the stored one, as the real server
//! takes it for a precondition), each write stamped with a new `resourceVersion`. A test can
//! have another writer get there first ([`super::ApiServer::interpose`]): the object it gave is
//! stored just before the next write to that name is served, which then meets it as it would
//! meet a replica's write made between its read and its own.
use serde_json::{json, Value};
use hyper::StatusCode;

use super::{answer, status, Answer, ApiState};

/// A collection: its plural, kind and apiVersion.
pub struct Kind {
    pub plural: &'static str,
    pub kind: &'static str,
    pub api_version: &'static str,
}

pub const SECRETS: Kind = Kind { plural: "secrets", kind: "Secret", api_version: "v1" };
pub const WEBHOOK_CONFIGURATIONS: Kind =
    Kind { plural: "mutatingwebhookconfigurations", kind: "MutatingWebhookConfiguration", api_version: "admissionregistration.k8s.io/v1" };

/// The key of an object: (plural, namespace or "", name).
pub type Key = (String, String, String);

fn key(kind: &Kind, namespace: &str, name: &str) -> Key {
    (kind.plural.to_owned(), namespace.to_owned(), name.to_owned())
}

/// A request for `kind` in `namespace` ("" cluster-scoped), `rest` the path after the plural.
pub fn serve(state: &mut ApiState, kind: &Kind, asked: (&str, Option<&str>), namespace: &str, rest: &[&str], body: &str) -> Answer {
    let (method, content_type) = asked;
    let group = kind.api_version.split_once('/').map_or("", |(g, _)| g);
    let what = if group.is_empty() { kind.plural.to_owned() } else { format!("{}.{group}", kind.plural) };
    match (method, rest) {
        ("GET", [name]) => match state.objects.get(&key(kind, namespace, name)) {
            Some(object) => answer(StatusCode::OK, object),
            None => status(StatusCode::NOT_FOUND, "NotFound", &format!("{what} \"{name}\" not found")),
        },
        ("POST", []) => {
            let mut object = match parsed(kind, namespace, None, body) {
                Ok(object) => object,
                Err(answer) => return *answer,
            };
            let name = object["metadata"]["name"].as_str().unwrap_or_default().to_owned();
            let key = key(kind, namespace, &name);
            interposed(state, &key);
            if state.objects.contains_key(&key) {
                return status(StatusCode::CONFLICT, "AlreadyExists", &format!("{what} \"{name}\" already exists"));
            }
            state.version += 1;
            let metadata = &mut object["metadata"];
            metadata["resourceVersion"] = json!(state.version.to_string());
            metadata["uid"] = json!(format!("0b1e0000-0000-4000-8000-{:012}", state.version));
            metadata["creationTimestamp"] = json!("2026-12-07T12:00:00Z");
            state.objects.insert(key, object.clone());
            answer(StatusCode::CREATED, &object)
        }
        ("PUT", [name]) => {
            let mut object = match parsed(kind, namespace, Some(name), body) {
                Ok(object) => object,
                Err(answer) => return *answer,
            };
            let key = key(kind, namespace, name);
            interposed(state, &key);
            let Some(existing) = state.objects.get(&key) else {
                return status(StatusCode::NOT_FOUND, "NotFound", &format!("{what} \"{name}\" not found"));
            };
            let asked = object["metadata"]["resourceVersion"].as_str().filter(|v| !v.is_empty());
            if asked.is_some_and(|v| Some(v) != existing["metadata"]["resourceVersion"].as_str()) {
                let message = format!("Operation cannot be fulfilled on {what} \"{name}\": the object has been modified; please apply your changes to the latest version and try again");
                return status(StatusCode::CONFLICT, "Conflict", &message);
            }
            if kind.kind == "Secret" && existing["type"] != object["type"] && !object["type"].is_null() {
                return status(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", &format!("Secret \"{name}\" is invalid: type: Invalid value: field is immutable"));
            }
            if kind.kind == "Secret" && object["type"].is_null() {
                object["type"] = existing["type"].clone();
            }
            state.version += 1;
            object["metadata"]["resourceVersion"] = json!(state.version.to_string());
            object["metadata"]["uid"] = existing["metadata"]["uid"].clone();
            object["metadata"]["creationTimestamp"] = existing["metadata"]["creationTimestamp"].clone();
            state.objects.insert(key, object.clone());
            answer(StatusCode::OK, &object)
        }
        ("PATCH", [name]) => {
            let key = key(kind, namespace, name);
            interposed(state, &key);
            let Some(existing) = state.objects.get(&key) else {
                return status(StatusCode::NOT_FOUND, "NotFound", &format!("{what} \"{name}\" not found"));
            };
            if content_type != Some("application/json-patch+json") {
                return status(StatusCode::UNSUPPORTED_MEDIA_TYPE, "UnsupportedMediaType", "this server takes JSON patches");
            }
            let Ok(patch) = serde_json::from_str::<json_patch::Patch>(body) else {
                return status(StatusCode::BAD_REQUEST, "BadRequest", "not a JSON patch");
            };
            let mut object = existing.clone();
            if let Err(error) = json_patch::patch(&mut object, &patch) {
                return status(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", &format!("the patch does not apply: {error}"));
            }
            // A resourceVersion the patch sets is a precondition, as for an update.
            if object["metadata"]["resourceVersion"] != existing["metadata"]["resourceVersion"] {
                let message = format!("Operation cannot be fulfilled on {what} \"{name}\": the object has been modified; please apply your changes to the latest version and try again");
                return status(StatusCode::CONFLICT, "Conflict", &message);
            }
            state.version += 1;
            object["metadata"]["resourceVersion"] = json!(state.version.to_string());
            state.objects.insert(key, object.clone());
            answer(StatusCode::OK, &object)
        }
        _ => status(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", "only GET of one, POST, PUT and a JSON PATCH here"),
    }
}

/// Stores the object another writer was to write to `key` first, if any.
fn interposed(state: &mut ApiState, key: &Key) {
    if let Some(at) = state.interpose.iter().position(|(k, _)| k == key) {
        let (_, mut object) = state.interpose.remove(at);
        state.version += 1;
        object["metadata"]["resourceVersion"] = json!(state.version.to_string());
        state.objects.insert(key.clone(), object);
    }
}

/// The body as an object of `kind` named as the path says, or the answer refusing it.
fn parsed(kind: &Kind, namespace: &str, name: Option<&str>, body: &str) -> Result<Value, Box<Answer>> {
    let Ok(mut object) = serde_json::from_str::<Value>(body) else {
        return Err(Box::new(status(StatusCode::BAD_REQUEST, "BadRequest", "not JSON")));
    };
    if object["apiVersion"] != kind.api_version || object["kind"] != kind.kind {
        return Err(Box::new(status(StatusCode::BAD_REQUEST, "BadRequest", &format!("expected apiVersion {}, kind {}", kind.api_version, kind.kind))));
    }
    let Some(own) = object["metadata"]["name"].as_str().filter(|n| !n.is_empty()) else {
        return Err(Box::new(status(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", "metadata.name: Required value")));
    };
    if name.is_some_and(|n| n != own) {
        return Err(Box::new(status(StatusCode::BAD_REQUEST, "BadRequest", "the name in the body does not match the path")));
    }
    if !namespace.is_empty() {
        if object["metadata"]["namespace"].as_str().is_some_and(|n| n != namespace) {
            return Err(Box::new(status(StatusCode::BAD_REQUEST, "BadRequest", "the namespace of the object does not match the namespace of the request")));
        }
        object["metadata"]["namespace"] = json!(namespace);
    }
    if kind.kind == "Secret" {
        if object["type"] == "kubernetes.io/tls" && (object["data"]["tls.crt"].is_null() || object["data"]["tls.key"].is_null()) {
            return Err(Box::new(status(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", "data[tls.crt] and data[tls.key]: Required value")));
        }
        if object["type"].is_null() && name.is_none() {
            object["type"] = json!("Opaque");
        }
    }
    Ok(object)
}

impl super::ApiServer {
    /// Another writer's `object` of `kind`, stored just before the next write to its name is
    /// served (that write then finds it there: `409` for a create or a stale version).
    pub fn interpose(&self, kind: &Kind, object: Value) {
        let namespace = object["metadata"]["namespace"].as_str().unwrap_or_default().to_owned();
        let name = object["metadata"]["name"].as_str().unwrap_or_default().to_owned();
        self.with(|s| s.interpose.push((key(kind, &namespace, &name), object)));
    }

    /// Whether an interposed write is still waiting.
    pub fn interposing(&self) -> bool {
        self.with(|s| !s.interpose.is_empty())
    }

    /// The stored object of `kind` (`namespace` "" for cluster-scoped), if any.
    pub fn object(&self, kind: &Kind, namespace: &str, name: &str) -> Option<Value> {
        self.with(|s| s.objects.get(&key(kind, namespace, name)).cloned())
    }

    /// Stores `object` as someone else would write it (created or replaced), with a new
    /// `resourceVersion`.
    pub fn put_object(&self, kind: &Kind, mut object: Value) {
        let namespace = object["metadata"]["namespace"].as_str().unwrap_or_default().to_owned();
        let name = object["metadata"]["name"].as_str().unwrap_or_default().to_owned();
        self.with(|s| {
            s.version += 1;
            object["metadata"]["resourceVersion"] = json!(s.version.to_string());
            s.objects.insert(key(kind, &namespace, &name), object);
        });
    }
}
