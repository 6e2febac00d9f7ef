//! What the agent keeps of the API's pods (`k8s-openapi`'s `Pod`, decoded by kube): each
//! container's `vramguard.io/gpu-memory` limit, parsed into bytes here
//! ([`PodQuotas::from_pod`]), and the UIDs the container runtime may know the pod by.
use std::collections::HashMap;

use k8s_openapi::api::core::v1::{Container, Pod};

use super::{parse_quantity, RESOURCE};

/// The annotation a mirror pod (the API's copy of a static pod) carries with the static pod's
/// UID, which is the UID the container runtime knows.
pub(crate) const MIRROR_ANNOTATION: &str = "kubernetes.io/config.mirror";

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
        let limit = |c: &Container| -> Limit {
            match c.resources.as_ref().and_then(|r| r.limits.as_ref()).and_then(|l| l.get(RESOURCE)) {
                None => Ok(None),
                Some(quantity) => parse_quantity(&quantity.0).map(Some).ok_or_else(|| quantity.0.clone()),
            }
        };
        let mut containers = HashMap::new();
        if let Some(spec) = &pod.spec {
            for c in spec.containers.iter().chain(spec.init_containers.iter().flatten()) {
                containers.insert(c.name.clone(), limit(c));
            }
            // Ephemeral containers cannot have resources: none has a quota.
            for c in spec.ephemeral_containers.iter().flatten() {
                containers.insert(c.name.clone(), Ok(None));
            }
        }
        let meta = &pod.metadata;
        PodQuotas {
            uid: meta.uid.clone().unwrap_or_default(),
            mirror_of: meta.annotations.as_ref().and_then(|a| a.get(MIRROR_ANNOTATION)).cloned(),
            containers,
        }
    }

    /// Whether this is the pod the runtime knows by `uid`.
    pub(crate) fn is(&self, uid: &str) -> bool {
        (!self.uid.is_empty() && self.uid == uid) || self.mirror_of.as_deref() == Some(uid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn null_limits_read_as_none() {
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
        assert!(quotas.is("u1") && quotas.is("s1") && !quotas.is("u2") && !quotas.is(""));
    }
}
