//! The admission webhook (`vramguard webhook`, issue 25 item 3): the real binary, serving HTTPS
//! with a certificate of the test's own CA (verified by the test's client against that CA),
//! writing its ResourceClaimTemplates to the mock API server (`kube_api`, TLS and a bearer
//! token, as in a pod). AdmissionReviews go in as the API server sends them; the returned
//! patch is applied to the original pod with RFC 6902 semantics and the result checked: a pod
//! with `vramguard.io/gpu-memory: 8Gi` ends with a claim of 8Gi memory and no extended
//! resource, a pod without it is untouched; beside `nvidia.com/gpu: N` the claim is of N GPUs
//! and `nvidia.com/gpu` is gone; an init container names a main container's claim that holds
//! it, a sidecar keeps its own.
mod kube_api;

use std::{
    ffi::OsString,
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use anyhow::{Context, Result};
use e2e::webhook::Webhook;
use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{header::CONTENT_TYPE, Method, Request};
use hyper_util::rt::TokioIo;
use kube_api::{ApiServer, Mode, TOKEN};
use rustls::pki_types::{pem::PemObject, CertificateDer, ServerName};
use serde_json::{json, Value};

const RESOURCE: &str = "vramguard.io/gpu-memory";
const NVIDIA_GPU: &str = "nvidia.com/gpu";

/// A CA of the test's own and a certificate for 127.0.0.1 it signed, written to `dir`:
/// (the CA's PEM, the certificate's file, the key's file).
fn certificate(dir: &Path) -> Result<(String, PathBuf, PathBuf)> {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, SanType};
    let ca_key = KeyPair::generate()?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(vec!["vramguard-webhook.vramguard-system.svc".to_owned()])?;
    params.subject_alt_names.push(SanType::IpAddress("127.0.0.1".parse()?));
    let cert = params.signed_by(&key, &issuer)?;
    let (cert_file, key_file) = (dir.join("tls.crt"), dir.join("tls.key"));
    // As the kubelet updates a mounted Secret: whole files, replaced.
    for (path, text) in [(&cert_file, cert.pem()), (&key_file, key.serialize_pem())] {
        let new = path.with_extension("new");
        std::fs::write(&new, text)?;
        std::fs::rename(&new, path)?;
    }
    Ok((ca.pem(), cert_file, key_file))
}

/// `vramguard webhook` serving `cert` and `key`, reaching `api` with the service account's
/// files in `account`.
fn start_webhook(dir: &Path, api: &ApiServer, account: &Path, cert: &Path, key: &Path) -> Result<Webhook> {
    let args: Vec<OsString> = vec!["--tls-cert".into(), cert.into(), "--tls-key".into(), key.into()];
    Webhook::spawn(dir.join("webhook.log"), api.addr.port(), account, &args)?.serving()
}

/// An HTTPS request to `addr`, the server verified against `ca_pem` for the name 127.0.0.1:
/// the status and body.
fn https(addr: SocketAddr, ca_pem: &str, method: Method, path: &str, body: Vec<u8>) -> Result<(u16, Vec<u8>)> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
            roots.add(cert?)?;
        }
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        let tls = tokio_rustls::TlsConnector::from(Arc::new(config)).connect(ServerName::try_from("127.0.0.1")?, tcp).await?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
        tokio::spawn(connection);
        let request = Request::builder()
            .method(method)
            .uri(path)
            .header("host", "vramguard-webhook.vramguard-system.svc")
            .header(CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))?;
        let response = tokio::time::timeout(e2e::timeout(), sender.send_request(request)).await??;
        let status = response.status().as_u16();
        let body = response.into_body().collect().await?.to_bytes().to_vec();
        Ok((status, body))
    })
}

/// An AdmissionReview of `pod`'s creation in `namespace`, as the API server sends it.
fn review(uid: &str, namespace: &str, pod: &Value, dry_run: bool) -> Vec<u8> {
    let review = json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": namespace, "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller", "groups": ["system:serviceaccounts"]},
            "object": pod, "oldObject": null, "dryRun": dry_run,
            "options": {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1"}
        }
    });
    serde_json::to_vec(&review).expect("json")
}

/// A pod of a ReplicaSet (a `generateName`, no name yet), as admission sees it: `main` asks
/// for `quota` (limits and requests) beside CPU, `sidecar` asks for nothing, and an init
/// container `fetch` asks for `init_quota`.
fn pod(namespace: &str, quota: Option<&str>, init_quota: Option<&str>) -> Value {
    let resources = |quota: Option<&str>| match quota {
        Some(q) => json!({"limits": {RESOURCE: q, "cpu": "2"}, "requests": {RESOURCE: q, "cpu": "1"}}),
        None => json!({"limits": {"cpu": "500m"}}),
    };
    json!({
        "kind": "Pod", "apiVersion": "v1",
        "metadata": {"generateName": "train-7d9f8c-", "namespace": namespace, "labels": {"app": "train"}},
        "spec": {
            "initContainers": [{"name": "fetch", "image": "registry.example/fetch:1", "resources": resources(init_quota)}],
            "containers": [
                {"name": "main", "image": "registry.example/ml/train:3.1", "resources": resources(quota)},
                {"name": "sidecar", "image": "registry.example/log:1", "resources": resources(None)}
            ],
            "restartPolicy": "Always", "schedulerName": "default-scheduler"
        }
    })
}

/// The review's `response`, checked to answer `uid`.
fn response(answer: &[u8], uid: &str) -> Result<Value> {
    let answer: Value = serde_json::from_slice(answer).context("the answer is JSON")?;
    assert_eq!(answer["apiVersion"], "admission.k8s.io/v1", "{answer}");
    assert_eq!(answer["kind"], "AdmissionReview", "{answer}");
    assert_eq!(answer["response"]["uid"], uid, "{answer}");
    Ok(answer["response"].clone())
}

/// `pod` with the response's patch applied (RFC 6902), as the API server does.
fn patched(pod: &Value, response: &Value) -> Result<Value> {
    assert_eq!(response["patchType"], "JSONPatch", "{response}");
    let patch = base64::engine::general_purpose::STANDARD.decode(response["patch"].as_str().context("a patch")?)?;
    let patch: json_patch::Patch = serde_json::from_slice(&patch).context("the patch is an RFC 6902 patch")?;
    let mut pod = pod.clone();
    json_patch::patch(&mut pod, &patch)?;
    Ok(pod)
}

/// An API server, its service account's files and the webhook's certificate under `dir`.
fn setup(dir: &Path) -> Result<(ApiServer, PathBuf, String, PathBuf, PathBuf)> {
    let api = ApiServer::start()?;
    let account = dir.join("account");
    api.service_account(&account)?;
    let (ca, cert, key) = certificate(dir)?;
    Ok((api, account, ca, cert, key))
}

#[test]
fn a_pod_with_8gi_gets_a_claim_of_8gi_memory_and_a_pod_without_it_is_untouched() -> Result<()> {
    let dir = e2e::TempDir::new("webhook")?;
    let (api, account, ca, cert, key) = setup(dir.path())?;
    let webhook = start_webhook(dir.path(), &api, &account, &cert, &key)?;

    let original = pod("ml", Some("8Gi"), Some("2Gi"));
    let uid = "3f6b1c2e-8d4a-4e7b-9c1d-2a3b4c5d6e7f";
    let (status, answer) = https(webhook.addr, &ca, Method::POST, "/mutate", review(uid, "ml", &original, false))?;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
    let first = response(&answer, uid)?;
    assert_eq!(first["allowed"], true, "{first}");
    let mutated = patched(&original, &first)?;
    // One claim, main's, from its size's template: the init container, which runs before
    // main starts and asks less, names it too (the pod holds the max, not the sum).
    assert_eq!(mutated["spec"]["resourceClaims"], json!([{"name": "vramguard-main", "resourceClaimTemplateName": "vramguard-gpu-memory-8gi"}]));
    let main = &mutated["spec"]["containers"][0];
    assert_eq!(main["resources"]["claims"], json!([{"name": "vramguard-main"}]));
    assert_eq!(main["resources"]["limits"], json!({"cpu": "2"}), "the extended resource is gone, the rest stays");
    assert_eq!(main["resources"]["requests"], json!({"cpu": "1"}));
    assert_eq!(mutated["spec"]["initContainers"][0]["resources"]["claims"], json!([{"name": "vramguard-main"}]));
    assert!(!mutated.to_string().contains(RESOURCE), "no {RESOURCE} left anywhere: {mutated}");
    assert_eq!(mutated["spec"]["containers"][1], original["spec"]["containers"][1], "the sidecar is untouched");
    assert_eq!(mutated["metadata"], original["metadata"]);

    // The templates are in the API server, written with the webhook's token: 8Gi of memory
    // on one device of the DeviceClass.
    let template = api.with(|s| s.templates.get(&("ml".to_owned(), "vramguard-gpu-memory-8gi".to_owned())).cloned()).context("the 8Gi template")?;
    assert_eq!(
        template["spec"]["spec"]["devices"]["requests"],
        json!([{"name": "gpu", "exactly": {"deviceClassName": "gpu.vramguard.io", "allocationMode": "ExactCount", "count": 1, "capacity": {"requests": {"memory": "8Gi"}}}}])
    );
    assert_eq!(template["metadata"]["labels"]["app.kubernetes.io/managed-by"], "vramguard-webhook");
    assert!(api.with(|s| s.templates.len() == 1), "no template for the init container's size");
    let posts = |api: &ApiServer| api.seen().iter().filter(|s| s.method == "POST").count();
    assert_eq!(posts(&api), 1);
    assert!(api.seen().iter().all(|s| s.authorization.as_deref() == Some(&format!("Bearer {TOKEN}"))));

    // The next pod of the same sizes (another spelling of 8 GiB): the same templates, read,
    // not written again.
    let second = pod("ml", Some("8192Mi"), Some("2Gi"));
    let (_, answer) = https(webhook.addr, &ca, Method::POST, "/mutate", review("second", "ml", &second, false))?;
    let patched_second = patched(&second, &response(&answer, "second")?)?;
    assert_eq!(patched_second["spec"]["resourceClaims"][0]["resourceClaimTemplateName"], "vramguard-gpu-memory-8gi");
    assert_eq!(posts(&api), 1, "nothing written for templates that exist");

    // A pod without the resource: allowed as it is, no patch, no call to the API server.
    let calls = api.seen().len();
    let plain = pod("ml", None, None);
    let (status, answer) = https(webhook.addr, &ca, Method::POST, "/mutate", review("plain", "ml", &plain, false))?;
    assert_eq!(status, 200);
    assert_eq!(response(&answer, "plain")?, json!({"uid": "plain", "allowed": true}));
    assert_eq!(api.seen().len(), calls);

    assert_eq!(webhook.sample("vramguard_webhook_reviews_total{result=\"mutated\"}")?, 2.0);
    assert_eq!(webhook.sample("vramguard_webhook_reviews_total{result=\"untouched\"}")?, 1.0);
    assert_eq!(webhook.sample("vramguard_webhook_templates_total{outcome=\"created\"}")?, 1.0);
    assert_eq!(webhook.sample("vramguard_webhook_templates_total{outcome=\"existing\"}")?, 1.0);
    assert_eq!(e2e::http::get(webhook.metrics, "/healthz")?, (200, "ok\n".to_owned()));
    Ok(())
}

/// A container of a pod: `name` with `resources`.
fn container(name: &str, resources: Value) -> Value {
    json!({"name": name, "image": format!("registry.example/{name}:1"), "resources": resources})
}

/// A pod of a ReplicaSet with these init containers and containers.
fn pod_of(namespace: &str, init: Vec<Value>, containers: Vec<Value>) -> Value {
    json!({
        "kind": "Pod", "apiVersion": "v1",
        "metadata": {"generateName": "train-7d9f8c-", "namespace": namespace},
        "spec": {"initContainers": init, "containers": containers, "restartPolicy": "Always"}
    })
}

/// The webhook's answer to `pod`'s creation in `ml`: its `response`.
fn admit(webhook: &Webhook, ca: &str, uid: &str, pod: &Value) -> Result<Value> {
    let (status, answer) = https(webhook.addr, ca, Method::POST, "/mutate", review(uid, "ml", pod, false))?;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
    response(&answer, uid)
}

#[test]
fn nvidia_gpu_beside_the_quota_becomes_the_claims_count_and_sidecars_keep_their_claim() -> Result<()> {
    let dir = e2e::TempDir::new("webhook-gpus")?;
    let (api, account, ca, cert, key) = setup(dir.path())?;
    let webhook = start_webhook(dir.path(), &api, &account, &cert, &key)?;
    let template = |name: &str| api.with(|s| s.templates.get(&("ml".to_owned(), name.to_owned())).cloned());

    // nvidia.com/gpu: 2 beside 8Gi: one claim of two GPUs with 8Gi on each, and nvidia.com/gpu
    // gone, so that the device plugin allocates nothing beside it.
    let two = pod_of(
        "ml",
        vec![],
        vec![container("train", json!({"limits": {RESOURCE: "8Gi", NVIDIA_GPU: "2", "cpu": "4"}, "requests": {RESOURCE: "8Gi", NVIDIA_GPU: "2", "cpu": "4"}}))],
    );
    let answer = admit(&webhook, &ca, "two", &two)?;
    assert_eq!(answer["allowed"], true, "{answer}");
    let mutated = patched(&two, &answer)?;
    assert_eq!(mutated["spec"]["resourceClaims"], json!([{"name": "vramguard-train", "resourceClaimTemplateName": "vramguard-gpu-memory-8gi-x2"}]));
    let train = &mutated["spec"]["containers"][0]["resources"];
    assert_eq!((&train["limits"], &train["requests"]), (&json!({"cpu": "4"}), &json!({"cpu": "4"})));
    assert_eq!(train["claims"], json!([{"name": "vramguard-train"}]));
    let written = template("vramguard-gpu-memory-8gi-x2").context("the template of two GPUs")?;
    assert_eq!(
        written["spec"]["spec"]["devices"]["requests"],
        json!([{"name": "gpu", "exactly": {"deviceClassName": "gpu.vramguard.io", "allocationMode": "ExactCount", "count": 2, "capacity": {"requests": {"memory": "8Gi"}}}}])
    );

    // nvidia.com/gpu: 1: the template of one GPU, as without it; the resource gone all the same.
    let one = pod_of("ml", vec![], vec![container("serve", json!({"limits": {RESOURCE: "8Gi", NVIDIA_GPU: "1"}}))]);
    let mutated = patched(&one, &admit(&webhook, &ca, "one", &one)?)?;
    assert_eq!(mutated["spec"]["resourceClaims"], json!([{"name": "vramguard-serve", "resourceClaimTemplateName": "vramguard-gpu-memory-8gi"}]));
    assert!(!mutated.to_string().contains(NVIDIA_GPU), "{mutated}");
    assert_eq!(template("vramguard-gpu-memory-8gi").context("the template of one GPU")?["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"], 1);

    // nvidia.com/gpu alone: the device plugin's, left as it is, no API call.
    let calls = api.seen().len();
    let plain = pod_of("ml", vec![], vec![container("cuda", json!({"limits": {NVIDIA_GPU: "2"}}))]);
    assert_eq!(admit(&webhook, &ca, "plain", &plain)?, json!({"uid": "plain", "allowed": true}));
    assert_eq!(api.seen().len(), calls);

    // A sidecar (restartPolicy: Always) runs beside main: a claim of its own. An init
    // container that asks more than main gets one of its own (main's quota is not raised).
    let mut proxy = container("proxy", json!({"limits": {RESOURCE: "2Gi"}}));
    proxy["restartPolicy"] = json!("Always");
    let sidecar = pod_of("ml", vec![proxy, container("convert", json!({"limits": {RESOURCE: "12Gi"}}))], vec![container("main", json!({"limits": {RESOURCE: "8Gi"}}))]);
    let mutated = patched(&sidecar, &admit(&webhook, &ca, "sidecar", &sidecar)?)?;
    assert_eq!(
        mutated["spec"]["resourceClaims"],
        json!([
            {"name": "vramguard-proxy", "resourceClaimTemplateName": "vramguard-gpu-memory-2gi"},
            {"name": "vramguard-convert", "resourceClaimTemplateName": "vramguard-gpu-memory-12gi"},
            {"name": "vramguard-main", "resourceClaimTemplateName": "vramguard-gpu-memory-8gi"}
        ])
    );
    let names: Vec<&Value> = ["initContainers", "containers"].iter().flat_map(|l| mutated["spec"][l].as_array().into_iter().flatten()).map(|c| &c["resources"]["claims"]).collect();
    assert_eq!(names, [&json!([{"name": "vramguard-proxy"}]), &json!([{"name": "vramguard-convert"}]), &json!([{"name": "vramguard-main"}])]);

    // What cannot be converted honestly is refused, saying what to write; nothing is written.
    let posts = api.seen().iter().filter(|s| s.method == "POST").count();
    for (uid, limits, requests, message) in [
        ("differ", json!({RESOURCE: "8Gi", NVIDIA_GPU: "2"}), json!({RESOURCE: "8Gi", NVIDIA_GPU: "1"}),
         "container \"train\": requests.nvidia.com/gpu (1) differs from limits.nvidia.com/gpu (2): write the same number of GPUs in both, or in limits alone"),
        ("zero", json!({RESOURCE: "8Gi", NVIDIA_GPU: "0"}), json!({}),
         "container \"train\": nvidia.com/gpu is 0 but vramguard.io/gpu-memory asks 8Gi on each of its GPUs: write nvidia.com/gpu: 1 or more, or remove vramguard.io/gpu-memory from a container that needs no GPU"),
        ("half", json!({RESOURCE: "8Gi", NVIDIA_GPU: "1.5"}), json!({}),
         "container \"train\": limits.nvidia.com/gpu \"1.5\" is not a whole number of GPUs: beside vramguard.io/gpu-memory it is the number of GPUs the quota is on, each with 8Gi (write e.g. nvidia.com/gpu: 2)"),
        ("many", json!({RESOURCE: "8Gi", NVIDIA_GPU: "64"}), json!({}),
         "container \"train\": nvidia.com/gpu 64 is more GPUs than one claim can be given (32, the API's limit on a claim's devices): write 32 or fewer"),
    ] {
        let pod = pod_of("ml", vec![], vec![container("train", json!({"limits": limits, "requests": requests}))]);
        let refused = admit(&webhook, &ca, uid, &pod)?;
        assert_eq!((refused["allowed"].clone(), refused["status"]["code"].clone()), (json!(false), json!(422)), "{refused}");
        assert_eq!(refused["status"]["message"], message);
    }
    assert_eq!(api.seen().iter().filter(|s| s.method == "POST").count(), posts);
    assert_eq!(webhook.sample("vramguard_webhook_reviews_total{result=\"denied\"}")?, 4.0);
    Ok(())
}

#[test]
fn refusals_bad_requests_dry_runs_and_an_api_server_down() -> Result<()> {
    let dir = e2e::TempDir::new("webhook-refusals")?;
    let (api, account, ca, cert, key) = setup(dir.path())?;
    let webhook = start_webhook(dir.path(), &api, &account, &cert, &key)?;
    let post = |body: Vec<u8>| https(webhook.addr, &ca, Method::POST, "/mutate", body);

    // Not a quantity: refused, with the container and the value named.
    let (status, answer) = post(review("bad", "ml", &pod("ml", Some("8GB"), None), false))?;
    assert_eq!(status, 200);
    let refused = response(&answer, "bad")?;
    assert_eq!(refused["allowed"], false);
    assert_eq!(refused["status"]["code"], 422);
    let message = refused["status"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("container \"main\"") && message.contains("\"8GB\" is not a quantity"), "{message}");

    // Malformed: 400 with the reason. Other methods, paths and oversized bodies: refused.
    let (status, answer) = post(b"{\"apiVersion\": \"admission.k8s.io/v1\", \"kind\": \"AdmissionReview\", \"request\": {\"uid\": 7}}".to_vec())?;
    assert_eq!(status, 400);
    assert!(String::from_utf8_lossy(&answer).contains("not an admission.k8s.io/v1 AdmissionReview"), "{}", String::from_utf8_lossy(&answer));
    assert_eq!(https(webhook.addr, &ca, Method::GET, "/mutate", Vec::new())?.0, 405);
    assert_eq!(https(webhook.addr, &ca, Method::POST, "/validate", Vec::new())?.0, 404);
    assert_eq!(post(vec![b' '; 5 << 20])?.0, 413);
    assert_eq!(webhook.sample("vramguard_webhook_reviews_total{result=\"bad_request\"}")?, 2.0);

    // A dry run: the patch, and nothing written.
    let (_, answer) = post(review("dry", "ml", &pod("ml", Some("8Gi"), None), true))?;
    assert_eq!(patched(&pod("ml", Some("8Gi"), None), &response(&answer, "dry")?)?["spec"]["resourceClaims"][0]["name"], "vramguard-main");
    assert!(api.with(|s| s.templates.is_empty()), "a dry run writes nothing");

    // A template of that name that asks for something else: never overwritten, the pod refused.
    api.with(|s| {
        let mut other = serde_json::to_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": "vramguard-gpu-memory-8gi", "namespace": "legacy"},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.vramguard.io", "capacity": {"requests": {"memory": "4Gi"}}}}]}}}
        }))
        .expect("json");
        other["metadata"]["resourceVersion"] = json!("5");
        s.templates.insert(("legacy".into(), "vramguard-gpu-memory-8gi".into()), other);
    });
    let (_, answer) = post(review("clash", "legacy", &pod("legacy", Some("8Gi"), None), false))?;
    let clash = response(&answer, "clash")?;
    assert_eq!(clash["allowed"], false);
    assert!(clash["status"]["message"].as_str().is_some_and(|m| m.contains("legacy/vramguard-gpu-memory-8gi") && m.contains("memory \"4Gi\"")), "{clash}");
    let kept = api.with(|s| s.templates[&("legacy".to_owned(), "vramguard-gpu-memory-8gi".to_owned())].clone());
    assert_eq!(kept["spec"]["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"]["memory"], "4Gi");

    // The API server failing: a pod that asks is refused with the reason (it would wait for a
    // claim that is never made); one that does not is admitted all the same.
    api.set_mode(Mode::Failing);
    let (_, answer) = post(review("down", "ml", &pod("ml", Some("8Gi"), None), false))?;
    let down = response(&answer, "down")?;
    assert_eq!(down["allowed"], false);
    assert_eq!(down["status"]["code"], 503, "{down}");
    let (_, answer) = post(review("plain", "ml", &pod("ml", None, None), false))?;
    assert_eq!(response(&answer, "plain")?["allowed"], true);
    assert_eq!(webhook.sample("vramguard_webhook_reviews_total{result=\"failed\"}")?, 1.0);
    assert_eq!(webhook.sample("vramguard_webhook_reviews_total{result=\"denied\"}")?, 2.0);
    Ok(())
}

#[test]
fn tls_is_verified_and_a_renewed_certificate_is_served_without_a_restart() -> Result<()> {
    let dir = e2e::TempDir::new("webhook-tls")?;
    let (api, account, ca, cert, key) = setup(dir.path())?;
    let webhook = start_webhook(dir.path(), &api, &account, &cert, &key)?;
    let plain = review("tls", "ml", &pod("ml", None, None), false);
    assert_eq!(https(webhook.addr, &ca, Method::POST, "/mutate", plain.clone())?.0, 200);
    // A client trusting another CA refuses the webhook's certificate.
    let other = dir.path().join("other");
    std::fs::create_dir_all(&other)?;
    let (other_ca, _, _) = certificate(&other)?;
    let error = https(webhook.addr, &other_ca, Method::POST, "/mutate", plain.clone()).expect_err("an unknown issuer");
    // (Both CAs have the same empty name: rustls finds the issuer by name, then its signature
    // fails to verify.)
    assert!(format!("{error:#}").contains("invalid peer certificate"), "{error:#}");
    // The Secret renewed (a new CA and certificate, the files replaced): served to new
    // connections within the reload period (10 s), without a restart.
    let (renewed_ca, _, _) = certificate(dir.path())?;
    e2e::wait_for(Duration::from_secs(30), "the renewed certificate is served", || {
        Ok(https(webhook.addr, &renewed_ca, Method::POST, "/mutate", plain.clone()).is_ok_and(|(status, _)| status == 200))
    })?;
    assert!(https(webhook.addr, &ca, Method::POST, "/mutate", plain).is_err(), "the old certificate is no longer served");
    assert_eq!(webhook.sample("vramguard_webhook_certificate_reloads_total{result=\"loaded\"}")?, 1.0);
    assert!(webhook.sample("vramguard_webhook_connections_total{outcome=\"tls_failed\"}")? >= 1.0);
    Ok(())
}
