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

/// ResourceClaims.
fn claims(_state: &mut ApiState, _asked: &Asked<'_>) -> Option<Answer> {
    None
}

/// ResourceSlices.
fn slices(_state: &mut ApiState, _asked: &Asked<'_>) -> Option<Answer> {
    None
}
