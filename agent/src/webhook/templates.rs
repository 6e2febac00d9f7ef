//! The ResourceClaimTemplates the webhook's pods name: one per [`Shape`] and namespace,
//! `vramguard-gpu-memory-<size>` on one GPU, `vramguard-gpu-memory-<size>-x<N>` on N
//! ([`super::mutate::template_name`]), asking for that many devices of the DeviceClass
//! (`gpu.vramguard.io` by default) with `capacity.requests.memory` = the size on each:
//!
//! ```yaml
//! spec:
//!   spec:
//!     devices:
//!       requests:
//!       - name: gpu
//!         exactly: {deviceClassName: gpu.vramguard.io, allocationMode: ExactCount, count: 1,
//!                   capacity: {requests: {memory: 8Gi}}}
//! ```
//!
//! The scheduler gives one request's devices distinct GPUs: its allocator looks for a
//! request's next device after the one it took last (k8s.io/dynamic-resource-allocation's
//! structured allocator), where a device that allows multiple allocations could otherwise be
//! taken again. No `distinctAttribute` constraint is written: it is a field of the
//! `DRAConsumableCapacity` gate, dropped where the gate is off (where each GPU is published
//! whole and cannot be taken twice anyway). Were one request ever given a GPU twice, prepare
//! sums the shares on it (`crate::dra::prepare::shares_of`): the quota would then be the sum
//! there, on fewer GPUs.
//!
//! [`Templates::ensure`] makes sure the template exists before the pod that names it is
//! admitted: a `GET` (one call once it exists), a `POST` when it does not, and on `409
//! AlreadyExists` (another replica was first) the `GET` again. A template of that name whose
//! spec asks for something else (edited by hand: templates are immutable, so it stays so) is
//! never overwritten: the pod is refused, naming it. The webhook writes nothing else, ever.
//!
//! Creations are capped at [`CREATIONS_PER_MINUTE`] (a new size in a namespace is rare; a
//! client that reaches the Service and forges reviews with ever new sizes or namespaces would
//! otherwise fill etcd with templates): past it the pod is refused, to be retried.
use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};

use k8s_openapi::{
    api::resource::v1::{CapacityRequirements, DeviceClaim, DeviceRequest, ExactDeviceRequest, ResourceClaimSpec, ResourceClaimTemplate, ResourceClaimTemplateSpec},
    apimachinery::pkg::{api::resource::Quantity, apis::meta::v1::ObjectMeta},
};
use kube::{api::PostParams, Api, Client};

use super::mutate::{quantity_text, template_name, Shape};
use crate::{
    dra::MEMORY,
    provision::kube::{parse_quantity, KubeError},
};

/// The request's name in every template (and in the claims made from them).
pub const REQUEST: &str = "gpu";
/// The label the webhook's templates carry.
pub const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "vramguard-webhook");
/// The field manager of the webhook's writes.
pub const FIELD_MANAGER: &str = "vramguard-webhook";

/// The most templates created in a minute.
pub const CREATIONS_PER_MINUTE: u32 = 30;

/// How [`Templates::ensure`] found the template.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ensured {
    Existing,
    Created,
}

/// Why a template could not be made sure of.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("ResourceClaimTemplate {namespace}/{name} exists and asks for something else ({why}): delete it, and the webhook recreates it")]
    Differs { namespace: String, name: String, why: String },
    #[error("more than {CREATIONS_PER_MINUTE} new ResourceClaimTemplates in a minute: {namespace}/{name} is not created now (retry)")]
    Capped { namespace: String, name: String },
    #[error(transparent)]
    Api(#[from] KubeError),
}

/// The creations of the current minute: its start and count.
#[derive(Debug)]
struct Minute {
    start: Instant,
    created: u32,
}

impl Minute {
    /// Takes one creation at `now`; `false` past the cap.
    fn take(&mut self, now: Instant) -> bool {
        if now.duration_since(self.start) >= Duration::from_secs(60) {
            (self.start, self.created) = (now, 0);
        }
        if self.created >= CREATIONS_PER_MINUTE {
            return false;
        }
        self.created += 1;
        true
    }
}

/// The templates' writer: the API client, the DeviceClass, each call's deadline.
#[derive(Clone)]
pub struct Templates {
    client: Client,
    class: String,
    deadline: Duration,
    minute: Arc<Mutex<Minute>>,
}

impl Templates {
    pub fn new(client: Client, class: String, deadline: Duration) -> Templates {
        let minute = Arc::new(Mutex::new(Minute { start: Instant::now(), created: 0 }));
        Templates { client, class, deadline, minute }
    }

    /// The template for `shape` in `namespace` exists with the spec this webhook writes
    /// (created if it did not).
    pub async fn ensure(&self, namespace: &str, shape: Shape) -> Result<Ensured, TemplateError> {
        let api: Api<ResourceClaimTemplate> = Api::namespaced(self.client.clone(), namespace);
        let name = template_name(shape);
        if let Some(existing) = self.call("reading", namespace, &name, api.get_opt(&name)).await? {
            return self.check(namespace, &existing, shape).map(|()| Ensured::Existing);
        }
        if !self.minute.lock().unwrap_or_else(PoisonError::into_inner).take(Instant::now()) {
            return Err(TemplateError::Capped { namespace: namespace.into(), name });
        }
        let params = PostParams { dry_run: false, field_manager: Some(FIELD_MANAGER.into()) };
        match self.call("creating", namespace, &name, api.create(&params, &template(namespace, shape, &self.class))).await {
            Ok(_) => Ok(Ensured::Created),
            Err(KubeError::Status { code: 409, .. }) => match self.call("reading", namespace, &name, api.get_opt(&name)).await? {
                Some(existing) => self.check(namespace, &existing, shape).map(|()| Ensured::Existing),
                None => Err(KubeError::Status { code: 409, what: format!("creating {namespace}/{name}"), message: "exists, then not found".into() }.into()),
            },
            Err(error) => Err(error.into()),
        }
    }

    fn check(&self, namespace: &str, existing: &ResourceClaimTemplate, shape: Shape) -> Result<(), TemplateError> {
        match differs(existing, shape, &self.class) {
            None => Ok(()),
            Some(why) => Err(TemplateError::Differs { namespace: namespace.into(), name: template_name(shape), why }),
        }
    }

    /// One API call, within the deadline.
    async fn call<T>(&self, doing: &str, namespace: &str, name: &str, call: impl std::future::Future<Output = kube::Result<T>>) -> Result<T, KubeError> {
        let what = format!("{doing} ResourceClaimTemplate {namespace}/{name}");
        match tokio::time::timeout(self.deadline, call).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(error)) => Err(KubeError::from_kube(what, error)),
            Err(_) => Err(KubeError::Timeout { what, after: self.deadline }),
        }
    }
}

/// The template the webhook writes for `shape` in `namespace`.
pub fn template(namespace: &str, shape: Shape, class: &str) -> ResourceClaimTemplate {
    let request = ExactDeviceRequest {
        device_class_name: class.to_owned(),
        allocation_mode: Some("ExactCount".into()),
        count: Some(i64::from(shape.gpus)),
        capacity: Some(CapacityRequirements { requests: Some(BTreeMap::from([(MEMORY.to_owned(), Quantity(quantity_text(shape.bytes)))])) }),
        ..ExactDeviceRequest::default()
    };
    ResourceClaimTemplate {
        metadata: ObjectMeta {
            name: Some(template_name(shape)),
            namespace: Some(namespace.to_owned()),
            labels: Some(BTreeMap::from([(MANAGED_BY.0.to_owned(), MANAGED_BY.1.to_owned())])),
            ..ObjectMeta::default()
        },
        spec: ResourceClaimTemplateSpec {
            metadata: None,
            spec: ResourceClaimSpec {
                devices: Some(DeviceClaim {
                    requests: Some(vec![DeviceRequest { name: REQUEST.into(), exactly: Some(request), first_available: None }]),
                    ..DeviceClaim::default()
                }),
            },
        },
    }
}

/// How `existing` differs from what the webhook writes for `shape` (quantities compared as
/// bytes: the API server may spell them otherwise; a count left out is 1); `None` when it
/// asks for the same.
pub fn differs(existing: &ResourceClaimTemplate, shape: Shape, class: &str) -> Option<String> {
    let devices = existing.spec.spec.devices.as_ref();
    if devices.is_some_and(|d| d.constraints.as_ref().is_some_and(|c| !c.is_empty()) || d.config.as_ref().is_some_and(|c| !c.is_empty())) {
        return Some("it has constraints or config".into());
    }
    let requests = devices.and_then(|d| d.requests.as_deref()).unwrap_or_default();
    let [request] = requests else { return Some(format!("{} requests, not 1", requests.len())) };
    let Some(exactly) = request.exactly.as_ref() else { return Some("its request is not `exactly`".into()) };
    if exactly.device_class_name != class {
        return Some(format!("DeviceClass {:?}, not {class:?}", exactly.device_class_name));
    }
    if exactly.allocation_mode.as_deref().is_some_and(|m| m != "ExactCount") {
        return Some(format!("allocation mode {:?}, not ExactCount", exactly.allocation_mode.as_deref().unwrap_or_default()));
    }
    let count = exactly.count.unwrap_or(1);
    if count != i64::from(shape.gpus) {
        return Some(format!("{count} devices, not {}", shape.gpus));
    }
    if exactly.selectors.as_ref().is_some_and(|s| !s.is_empty()) || exactly.admin_access == Some(true) {
        return Some("it has selectors or admin access".into());
    }
    let memory = exactly.capacity.as_ref().and_then(|c| c.requests.as_ref()).and_then(|r| r.get(MEMORY));
    match memory.map(|q| parse_quantity(&q.0)) {
        Some(Some(asked)) if asked == shape.bytes => None,
        Some(_) => Some(format!("memory {:?}, not {}", memory.map(|q| q.0.as_str()).unwrap_or_default(), quantity_text(shape.bytes))),
        None => Some("no memory request".into()),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn creations_are_capped_per_minute() {
        let start = Instant::now();
        let mut minute = Minute { start, created: 0 };
        assert!((0..CREATIONS_PER_MINUTE).all(|_| minute.take(start)));
        assert!(!minute.take(start + Duration::from_secs(59)), "past the cap within the minute");
        assert!(minute.take(start + Duration::from_secs(60)), "a new minute");
    }

    #[test]
    fn the_template_on_the_wire() {
        let written = serde_json::to_value(template("ml", Shape::one(8 << 30), "gpu.vramguard.io")).expect("json");
        assert_eq!(
            written,
            json!({
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                "metadata": {"name": "vramguard-gpu-memory-8gi", "namespace": "ml", "labels": {"app.kubernetes.io/managed-by": "vramguard-webhook"}},
                "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                    "deviceClassName": "gpu.vramguard.io", "allocationMode": "ExactCount", "count": 1,
                    "capacity": {"requests": {"memory": "8Gi"}}
                }}]}}}
            })
        );
        // Two GPUs with 8 GiB on each: one request of two devices, the count in the name.
        let two = serde_json::to_value(template("ml", Shape { bytes: 8 << 30, gpus: 2 }, "gpu.vramguard.io")).expect("json");
        assert_eq!(two["metadata"]["name"], "vramguard-gpu-memory-8gi-x2");
        assert_eq!(
            two["spec"]["spec"]["devices"]["requests"],
            json!([{"name": "gpu", "exactly": {
                "deviceClassName": "gpu.vramguard.io", "allocationMode": "ExactCount", "count": 2,
                "capacity": {"requests": {"memory": "8Gi"}}
            }}])
        );
    }

    fn exactly(t: &mut ResourceClaimTemplate) -> &mut ExactDeviceRequest {
        t.spec.spec.devices.as_mut().and_then(|d| d.requests.as_mut()).and_then(|r| r[0].exactly.as_mut()).expect("request")
    }

    #[test]
    fn what_differs() {
        let class = "gpu.vramguard.io";
        let eight = Shape::one(8 << 30);
        let ours = template("ml", eight, class);
        assert_eq!(differs(&ours, eight, class), None);
        // The same bytes spelled otherwise, defaults left out: the same.
        let mut respelled = ours.clone();
        exactly(&mut respelled).capacity = Some(CapacityRequirements { requests: Some(BTreeMap::from([(MEMORY.into(), Quantity("8589934592".into()))])) });
        exactly(&mut respelled).allocation_mode = None;
        exactly(&mut respelled).count = None;
        assert_eq!(differs(&respelled, eight, class), None);
        assert!(differs(&ours, Shape::one(4 << 30), class).is_some_and(|why| why.contains("memory \"8Gi\", not 4Gi")));
        assert!(differs(&ours, eight, "other.class").is_some_and(|why| why.contains("DeviceClass")));
        let mut two = ours.clone();
        exactly(&mut two).count = Some(2);
        assert!(differs(&two, eight, class).is_some_and(|why| why == "2 devices, not 1"), "{:?}", differs(&two, eight, class));
        assert_eq!(differs(&two, Shape { bytes: 8 << 30, gpus: 2 }, class), None);
        // A count left out is one device, not two.
        assert!(differs(&respelled, Shape { bytes: 8 << 30, gpus: 2 }, class).is_some_and(|why| why == "1 devices, not 2"));
        let mut all = ours.clone();
        exactly(&mut all).allocation_mode = Some("All".into());
        assert!(differs(&all, eight, class).is_some_and(|why| why.contains("not ExactCount")));
        let mut empty = ours;
        empty.spec.spec.devices = None;
        assert!(differs(&empty, eight, class).is_some_and(|why| why.contains("0 requests")));
    }
}
