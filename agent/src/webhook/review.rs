//! One AdmissionReview (`admission.k8s.io/v1`) in, its answer out. The review is decoded by
//! kube's admission types; a body that is not one (or a pod's creation without a v1 Pod in
//! it) is a 400 with the reason, never a guess. A pod's `CREATE` is mutated ([`mutate`]):
//!
//! * nothing to convert: `allowed: true`, no patch;
//! * a refusal (an invalid quantity, a clash): `allowed: false`, status 422 and the reason;
//! * otherwise the pod's templates are made sure of ([`TemplateStore::ensure`]; skipped on
//!   a dry run, which the configuration's `sideEffects: NoneOnDryRun` promises), then
//!   `allowed: true`, `patchType: JSONPatch` and the patch in base64. A template that cannot
//!   be made sure of refuses the pod (503, or 409 when a template of that name asks for
//!   something else): admitted, it would wait for a claim that is never made.
//!
//! Every other operation and kind is allowed untouched (the configuration sends only pods'
//! creations; a wider one must not block anything).
use std::{future::Future, time::Instant};

use base64::Engine as _;
use hyper::StatusCode;
use k8s_openapi::api::core::v1::Pod;
use kube::core::{
    admission::{AdmissionRequest, AdmissionReview, Operation, META_API_VERSION_V1, META_KIND},
    DynamicObject,
};
use serde_json::{json, Value};
use tracing::{debug, info, warn};

use super::{
    metrics::WebhookMetrics,
    mutate::{mutate, Shape},
    templates::{Ensured, TemplateError, Templates},
};

/// Where the pods' templates are made sure of: the API server ([`Templates`]), or a test's.
pub trait TemplateStore: Sync {
    fn ensure(&self, namespace: &str, shape: Shape) -> impl Future<Output = Result<Ensured, TemplateError>> + Send;
}

impl TemplateStore for Templates {
    fn ensure(&self, namespace: &str, shape: Shape) -> impl Future<Output = Result<Ensured, TemplateError>> + Send {
        Templates::ensure(self, namespace, shape)
    }
}

/// The HTTP answer to a review: its status and JSON body.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub body: Value,
}

/// The answer to the review in `body`.
pub async fn answer(body: &[u8], store: &impl TemplateStore, metrics: &WebhookMetrics) -> Answer {
    let started = Instant::now();
    let (result, answer) = decide(body, store, metrics).await;
    metrics.review(result, started.elapsed().as_secs_f64());
    answer
}

async fn decide(body: &[u8], store: &impl TemplateStore, metrics: &WebhookMetrics) -> (&'static str, Answer) {
    let request = match decode(body) {
        Ok(request) => request,
        Err(reason) => {
            debug!(%reason, "a request that is not an AdmissionReview");
            return ("bad_request", Answer { status: StatusCode::BAD_REQUEST, body: json!({"error": reason}) });
        }
    };
    let uid = request.uid.clone();
    let is_pod = request.kind.group.is_empty() && request.kind.version == "v1" && request.kind.kind == "Pod";
    if !is_pod || request.operation != Operation::Create || request.sub_resource.is_some() {
        return ("untouched", allowed(&uid, None, &[]));
    }
    let pod: Pod = match request.object.as_ref().map(|object| serde_json::to_value(object).and_then(serde_json::from_value)) {
        Some(Ok(pod)) => pod,
        Some(Err(error)) => {
            let reason = format!("the review's object is not a v1 Pod: {error}");
            return ("bad_request", Answer { status: StatusCode::BAD_REQUEST, body: json!({"error": reason}) });
        }
        None => {
            let reason = "a pod's creation without the pod (request.object)".to_owned();
            return ("bad_request", Answer { status: StatusCode::BAD_REQUEST, body: json!({"error": reason}) });
        }
    };
    let name = pod.metadata.name.clone().or_else(|| pod.metadata.generate_name.clone()).unwrap_or_default();
    let mutation = match mutate(&pod) {
        Ok(mutation) => mutation,
        Err(refusal) => {
            info!(pod = %name, reason = %refusal, "pod refused");
            return ("denied", denied(&uid, 422, "Invalid", &refusal.0));
        }
    };
    if mutation.patch.is_empty() {
        return ("untouched", allowed(&uid, None, &[]));
    }
    let Some(namespace) = request.namespace.clone().or_else(|| pod.metadata.namespace.clone()) else {
        return ("bad_request", Answer { status: StatusCode::BAD_REQUEST, body: json!({"error": "a pod's creation without a namespace"}) });
    };
    if !request.dry_run {
        for &shape in &mutation.shapes {
            match store.ensure(&namespace, shape).await {
                Ok(Ensured::Existing) => metrics.template("existing"),
                Ok(Ensured::Created) => {
                    metrics.template("created");
                    info!(%namespace, %shape, "ResourceClaimTemplate created");
                }
                Err(error @ TemplateError::Differs { .. }) => {
                    metrics.template("differs");
                    warn!(%namespace, pod = %name, %error, "pod refused");
                    return ("denied", denied(&uid, 409, "Conflict", &error.to_string()));
                }
                Err(error @ TemplateError::Capped { .. }) => {
                    metrics.template("capped");
                    warn!(%namespace, pod = %name, %error, "pod refused");
                    return ("failed", denied(&uid, 429, "TooManyRequests", &error.to_string()));
                }
                Err(TemplateError::Api(error)) => {
                    metrics.template("error");
                    warn!(%namespace, pod = %name, %error, "pod refused: its template could not be made sure of");
                    let message = format!("vramguard cannot make sure of the pod's ResourceClaimTemplate: {error}");
                    return ("failed", denied(&uid, 503, "ServiceUnavailable", &message));
                }
            }
        }
    }
    let shapes: Vec<String> = mutation.shapes.iter().map(Shape::to_string).collect();
    debug!(%namespace, pod = %name, ?shapes, dry_run = request.dry_run, "pod converted to claims");
    let warnings = mutation.warnings.clone();
    match serde_json::to_vec(&mutation.into_patch()) {
        Ok(patch) => ("mutated", allowed(&uid, Some(&patch), &warnings)),
        Err(error) => ("failed", denied(&uid, 500, "InternalError", &format!("encoding the patch: {error}"))),
    }
}

/// The review's request, checked: `admission.k8s.io/v1`, kind `AdmissionReview`, a request.
fn decode(body: &[u8]) -> Result<AdmissionRequest<DynamicObject>, String> {
    let review: AdmissionReview<DynamicObject> =
        serde_json::from_slice(body).map_err(|e| format!("not an admission.k8s.io/v1 AdmissionReview: {e}"))?;
    if review.types.api_version != META_API_VERSION_V1 || review.types.kind != META_KIND {
        return Err(format!(
            "not an admission.k8s.io/v1 AdmissionReview: apiVersion {:?}, kind {:?} (admissionReviewVersions must be [v1])",
            review.types.api_version, review.types.kind
        ));
    }
    review.try_into().map_err(|_| "an AdmissionReview without a request".to_owned())
}

fn review(response: Value) -> Answer {
    Answer { status: StatusCode::OK, body: json!({"apiVersion": META_API_VERSION_V1, "kind": META_KIND, "response": response}) }
}

/// `allowed: true`, with the JSON patch (base64, as the API's `[]byte` is on the wire) if any.
fn allowed(uid: &str, patch: Option<&[u8]>, warnings: &[String]) -> Answer {
    let mut response = json!({"uid": uid, "allowed": true});
    if let Some(patch) = patch {
        response["patchType"] = json!("JSONPatch");
        response["patch"] = json!(base64::engine::general_purpose::STANDARD.encode(patch));
    }
    if !warnings.is_empty() {
        response["warnings"] = json!(warnings);
    }
    review(response)
}

fn denied(uid: &str, code: u16, reason: &str, message: &str) -> Answer {
    review(json!({"uid": uid, "allowed": false, "status": {"code": code, "reason": reason, "message": message}}))
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::provision::kube::{KubeError, RESOURCE};

    /// Records the templates asked for; fails as told.
    #[derive(Default)]
    struct Store {
        asked: Mutex<Vec<(String, Shape)>>,
        fail: Option<fn() -> TemplateError>,
    }

    impl TemplateStore for Store {
        fn ensure(&self, namespace: &str, shape: Shape) -> impl Future<Output = Result<Ensured, TemplateError>> + Send {
            self.asked.lock().expect("lock").push((namespace.to_owned(), shape));
            let result = match self.fail {
                Some(fail) => Err(fail()),
                None => Ok(Ensured::Created),
            };
            async move { result }
        }
    }

    fn review_of(pod: Value, operation: &str, dry_run: bool) -> Vec<u8> {
        serde_json::to_vec(&json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {
                "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "namespace": "ml", "operation": operation,
                "userInfo": {"username": "alice"},
                "object": pod, "dryRun": dry_run
            }
        }))
        .expect("json")
    }

    fn pod(quantity: Option<&str>) -> Value {
        let resources = quantity.map_or(json!({}), |q| json!({"limits": {RESOURCE: q}}));
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"generateName": "train-", "namespace": "ml"},
               "spec": {"containers": [{"name": "main", "image": "x", "resources": resources}]}})
    }

    async fn run(body: &[u8], store: &Store) -> (Answer, WebhookMetrics) {
        let metrics = WebhookMetrics::new(&prometheus::Registry::new()).expect("metrics");
        (answer(body, store, &metrics).await, metrics)
    }

    #[tokio::test]
    async fn a_pod_that_asks_gets_its_template_and_a_base64_patch() {
        let store = Store::default();
        let (answer, metrics) = run(&review_of(pod(Some("8Gi")), "CREATE", false), &store).await;
        assert_eq!(answer.status, StatusCode::OK);
        let response = &answer.body["response"];
        assert_eq!(answer.body["apiVersion"], "admission.k8s.io/v1");
        assert_eq!(response["uid"], "705ab4f5-6393-11e8-b7cc-42010a800002");
        assert_eq!(response["allowed"], true);
        assert_eq!(response["patchType"], "JSONPatch");
        let patch = base64::engine::general_purpose::STANDARD.decode(response["patch"].as_str().expect("patch")).expect("base64");
        let patch: json_patch::Patch = serde_json::from_slice(&patch).expect("a JSON patch");
        let mut patched = pod(Some("8Gi"));
        json_patch::patch(&mut patched, &patch).expect("applies");
        assert_eq!(patched["spec"]["resourceClaims"], json!([{"name": "vramguard-main", "resourceClaimTemplateName": "vramguard-gpu-memory-8gi"}]));
        assert_eq!(*store.asked.lock().expect("lock"), vec![("ml".to_owned(), Shape::one(8 << 30))]);
        assert_eq!(metrics.reviews("mutated"), 1);
    }

    #[tokio::test]
    async fn untouched_denied_dry_run_and_other_operations() {
        let store = Store::default();
        let (answer, metrics) = run(&review_of(pod(None), "CREATE", false), &store).await;
        assert_eq!(answer.body["response"], json!({"uid": "705ab4f5-6393-11e8-b7cc-42010a800002", "allowed": true}));
        assert_eq!(metrics.reviews("untouched"), 1);
        let (answer, metrics) = run(&review_of(pod(Some("8 GiB")), "CREATE", false), &store).await;
        assert_eq!(answer.body["response"]["allowed"], false);
        assert_eq!(answer.body["response"]["status"]["code"], 422);
        assert!(answer.body["response"]["status"]["message"].as_str().is_some_and(|m| m.contains("\"8 GiB\" is not a quantity")));
        assert_eq!(metrics.reviews("denied"), 1);
        // A dry run: patched, nothing written.
        let (answer, _) = run(&review_of(pod(Some("8Gi")), "CREATE", true), &store).await;
        assert_eq!(answer.body["response"]["patchType"], "JSONPatch");
        // An update is not converted (the pod's resources are what was admitted).
        let (answer, _) = run(&review_of(pod(Some("8Gi")), "UPDATE", false), &store).await;
        assert!(answer.body["response"].get("patch").is_none());
        assert!(store.asked.lock().expect("lock").is_empty(), "no template for a dry run, a refusal or an update");
    }

    #[tokio::test]
    async fn a_template_that_cannot_be_made_sure_of_refuses_the_pod() {
        let store = Store { fail: Some(|| TemplateError::Api(KubeError::Timeout { what: "creating".into(), after: std::time::Duration::from_secs(3) })), ..Store::default() };
        let (answer, metrics) = run(&review_of(pod(Some("8Gi")), "CREATE", false), &store).await;
        assert_eq!(answer.body["response"]["allowed"], false);
        assert_eq!(answer.body["response"]["status"]["code"], 503);
        assert_eq!(metrics.reviews("failed"), 1);
    }

    #[tokio::test]
    async fn malformed_reviews_are_400s_with_the_reason() {
        let store = Store::default();
        for (body, reason) in [
            (b"{not json".to_vec(), "not an admission.k8s.io/v1 AdmissionReview"),
            (br#"{"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", "request": null}"#.to_vec(), "admissionReviewVersions must be [v1]"),
            (br#"{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}"#.to_vec(), "without a request"),
            (review_of(json!({"spec": {"containers": "many"}}), "CREATE", false), "not a v1 Pod"),
            (review_of(Value::Null, "CREATE", false), "without the pod"),
        ] {
            let (answer, metrics) = run(&body, &store).await;
            assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{reason}");
            assert!(answer.body["error"].as_str().is_some_and(|e| e.contains(reason)), "{reason}: {}", answer.body);
            assert_eq!(metrics.reviews("bad_request"), 1);
        }
    }
}
