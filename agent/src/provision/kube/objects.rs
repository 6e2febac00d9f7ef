//! The parts of the API's objects the agent reads (everything else in them is ignored):
//! pods' identity and containers' limits, lists and watch events of pods, a node's capacity,
//! and the `Status` the API answers errors with. This is where the API server's JSON becomes
//! typed values; limits are parsed into bytes here ([`PodQuotas::from_pod`]).
use std::collections::{BTreeMap, HashMap};

use serde::Deserialize;

use super::{parse_quantity, RESOURCE};

/// `null` (which the API writes for some empty fields, e.g. a bookmark's
/// `spec.containers`) as the type's default.
fn null_as_default<'de, D: serde::Deserializer<'de>, T: Default + Deserialize<'de>>(d: D) -> Result<T, D::Error> {
    Option::<T>::deserialize(d).map(Option::unwrap_or_default)
}

/// The annotation a mirror pod (the API's copy of a static pod) carries with the static pod's
/// UID, which is the UID the container runtime knows.
pub(crate) const MIRROR_ANNOTATION: &str = "kubernetes.io/config.mirror";

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub(crate) struct ObjectMeta {
    #[serde(deserialize_with = "null_as_default")]
    pub name: String,
    #[serde(deserialize_with = "null_as_default")]
    pub namespace: String,
    #[serde(deserialize_with = "null_as_default")]
    pub uid: String,
    #[serde(deserialize_with = "null_as_default")]
    pub resource_version: String,
    #[serde(deserialize_with = "null_as_default")]
    pub annotations: BTreeMap<String, String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub(crate) struct ListMeta {
    pub resource_version: String,
    #[serde(rename = "continue")]
    pub continue_token: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub(crate) struct Pod {
    #[serde(deserialize_with = "null_as_default")]
    pub metadata: ObjectMeta,
    #[serde(deserialize_with = "null_as_default")]
    pub spec: PodSpec,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub(crate) struct PodSpec {
    pub node_name: String,
    #[serde(deserialize_with = "null_as_default")]
    pub containers: Vec<Container>,
    #[serde(deserialize_with = "null_as_default")]
    pub init_containers: Vec<Container>,
    #[serde(deserialize_with = "null_as_default")]
    pub ephemeral_containers: Vec<Container>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct Container {
    #[serde(deserialize_with = "null_as_default")]
    pub name: String,
    #[serde(deserialize_with = "null_as_default")]
    pub resources: Resources,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct Resources {
    #[serde(deserialize_with = "null_as_default")]
    pub limits: BTreeMap<String, String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct PodList {
    #[serde(deserialize_with = "null_as_default")]
    pub metadata: ListMeta,
    #[serde(deserialize_with = "null_as_default")]
    pub items: Vec<Pod>,
}

/// One line of a watch.
#[derive(Debug, Deserialize)]
pub(crate) struct WatchEvent {
    #[serde(rename = "type")]
    pub kind: String,
    pub object: serde_json::Value,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct Node {
    #[serde(deserialize_with = "null_as_default")]
    pub metadata: ObjectMeta,
    #[serde(deserialize_with = "null_as_default")]
    pub status: NodeStatus,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct NodeStatus {
    #[serde(deserialize_with = "null_as_default")]
    pub capacity: BTreeMap<String, String>,
}

/// The API's answer to a failed request (and a watch's `ERROR` event's object).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct Status {
    pub code: u16,
    pub reason: String,
    pub message: String,
}

/// A container's `vramguard.io/gpu-memory` limit: bytes, none, or the text that is not a
/// whole number of bytes.
pub(crate) type Limit = Result<Option<u64>, String>;

/// What the cache keeps of a pod.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PodQuotas {
    pub uid: String,
    /// The static pod's UID when this is a mirror pod.
    pub mirror_of: Option<String>,
    /// Every container by name: regular, init and ephemeral ones.
    pub containers: HashMap<String, Limit>,
}

impl PodQuotas {
    pub(crate) fn from_pod(pod: &Pod) -> PodQuotas {
        let spec = &pod.spec;
        let containers = spec
            .containers
            .iter()
            .chain(&spec.init_containers)
            .chain(&spec.ephemeral_containers)
            .map(|c| {
                let limit = match c.resources.limits.get(RESOURCE) {
                    None => Ok(None),
                    Some(text) => parse_quantity(text).map(Some).ok_or_else(|| text.clone()),
                };
                (c.name.clone(), limit)
            })
            .collect();
        PodQuotas {
            uid: pod.metadata.uid.clone(),
            mirror_of: pod.metadata.annotations.get(MIRROR_ANNOTATION).cloned(),
            containers,
        }
    }

    /// Whether this is the pod the runtime knows by `uid`.
    pub(crate) fn is(&self, uid: &str) -> bool {
        self.uid == uid || self.mirror_of.as_deref() == Some(uid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nulls_read_as_empty() {
        let bookmark = r#"{"kind":"Pod","apiVersion":"v1","metadata":{"resourceVersion":"12746","creationTimestamp":null},"spec":{"containers":null},"status":{}}"#;
        let pod: Pod = serde_json::from_str(bookmark).expect("a bookmark's object");
        assert_eq!(pod.metadata.resource_version, "12746");
        assert!(pod.spec.containers.is_empty());
        let pod: Pod = serde_json::from_str(r#"{"metadata":null,"spec":{"containers":[{"name":"a","resources":{"limits":null}}]}}"#)
            .expect("null limits");
        assert_eq!(PodQuotas::from_pod(&pod).containers.get("a"), Some(&Ok(None)));
    }

    #[test]
    fn limits_are_parsed_per_container() {
        let pod: Pod = serde_json::from_str(
            r#"{"metadata":{"uid":"u1","annotations":{"kubernetes.io/config.mirror":"s1"}},"spec":{
                "containers":[{"name":"a","resources":{"limits":{"vramguard.io/gpu-memory":"8Gi","cpu":"2"}}},{"name":"b"}],
                "initContainers":[{"name":"i","resources":{"limits":{"vramguard.io/gpu-memory":"1.5x"}}}],
                "ephemeralContainers":[{"name":"debugger"}]}}"#,
        )
        .expect("pod");
        let quotas = PodQuotas::from_pod(&pod);
        assert_eq!(quotas.containers.get("a"), Some(&Ok(Some(8 << 30))));
        assert_eq!(quotas.containers.get("b"), Some(&Ok(None)));
        assert_eq!(quotas.containers.get("i"), Some(&Err("1.5x".to_owned())));
        assert_eq!(quotas.containers.get("debugger"), Some(&Ok(None)));
        assert!(quotas.is("u1") && quotas.is("s1") && !quotas.is("u2"));
    }
}
