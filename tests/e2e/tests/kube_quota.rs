//! Quotas through Kubernetes, end to end (issue "Ship what operators install", item 5): the
//! agent runs as containerd's NRI plugin with `--kube` alone (no quota file), reaching an API
//! server as a pod does: in-cluster configuration (`KUBERNETES_SERVICE_HOST`/`PORT`, the
//! service account's token and CA in a directory it is told about), TLS, a list and a watch of
//! its node's pods. The API server is a small one in this test, serving pods as the real one
//! writes them and recording what it is asked.
//!
//! Shown: a pod whose container asks `vramguard.io/gpu-memory: 1Gi`, and sets
//! `CUDA_DEVICE_MEMORY_LIMIT=64g` in its own spec, is held to 1 GiB (a hooked workload in it is
//! refused past it, whatever its environment says); that pod reaches the agent only through
//! the watch (the server answers 404 to a direct GET of it), so the quota came from the API's
//! pod spec; the node's capacity is published through the status subresource; a pod with the
//! same environment and no resource is untouched (no ledger, no hook): the container's own
//! environment never provisions anything.
//!
//! Needs root, the containerd cache (`cargo xtask setup`) and the built binaries.
use std::{
    collections::HashMap,
    convert::Infallible,
    ffi::{OsStr, OsString},
    net::SocketAddr,
    path::Path,
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context as TaskContext, Poll},
    time::Duration,
};

use anyhow::{ensure, Context, Result};
use bytes::Bytes;
use e2e::{
    agent::Agent,
    containerd::{workload_path, ContainerId, ContainerSpec, Containerd},
    timeout, wait_for, FakeNode, TempDir, GIB,
};
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::{
    body::{Body, Frame, Incoming},
    header::{AUTHORIZATION, CONTENT_TYPE},
    server::conn::http1,
    service::service_fn,
    Request, Response, StatusCode,
};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::sync::mpsc;

const NODE: &str = "gpu-node-7";
const TOKEN: &str = "e2e-service-account-token";
const RESOURCE: &str = "vramguard.io/gpu-memory";

/// A request the API server received.
#[derive(Clone, Debug)]
struct Seen {
    method: String,
    target: String,
    authorization: Option<String>,
    body: String,
}

#[derive(Default)]
struct ApiState {
    seen: Vec<Seen>,
    /// Every pod the server knows, with whether a direct GET finds it (false: only the watch
    /// tells of it).
    pods: Vec<(Value, bool)>,
    node: Value,
    watches: Vec<mpsc::UnboundedSender<Bytes>>,
    version: u64,
}

/// The API server: TLS on a loopback port with its own CA, one node and its pods.
struct ApiServer {
    addr: SocketAddr,
    state: Arc<Mutex<ApiState>>,
    /// The CA's certificate (PEM), for the service account directory.
    ca_pem: String,
    _runtime: tokio::runtime::Runtime,
}

/// A watch's body: the events the test sends, as they come.
struct Events(mpsc::UnboundedReceiver<Bytes>);

impl Body for Events {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|chunk| chunk.map(|c| Ok(Frame::data(c))))
    }
}

type Answer = Response<BoxBody<Bytes, Infallible>>;

fn answer(status: StatusCode, value: &Value) -> Answer {
    Response::builder()
        .status(status)
        .header(CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(value.to_string())).boxed())
        .expect("a response")
}

fn status(code: StatusCode, reason: &str, message: &str) -> Answer {
    let body = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message, "reason": reason, "code": code.as_u16()});
    answer(code, &body)
}

impl ApiServer {
    fn start() -> Result<ApiServer> {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
        let (tls, ca_pem) = server_tls()?;
        let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
        let addr = listener.local_addr()?;
        let node = json!({
            "kind": "Node", "apiVersion": "v1",
            "metadata": {"name": NODE, "uid": "9d1c7a52-0b7e-4f0e-a3c5-1f2e3d4c5b6a", "resourceVersion": "90"},
            "status": {"capacity": {"cpu": "16", "memory": "131891508Ki", "pods": "110"}}
        });
        let state = Arc::new(Mutex::new(ApiState { node, version: 100, ..ApiState::default() }));
        let served = state.clone();
        runtime.spawn(async move {
            let acceptor = tokio_rustls::TlsAcceptor::from(tls);
            while let Ok((tcp, _)) = listener.accept().await {
                let (acceptor, state) = (acceptor.clone(), served.clone());
                tokio::spawn(async move {
                    let Ok(stream) = acceptor.accept(tcp).await else { return };
                    let service = service_fn(move |request| {
                        let state = state.clone();
                        async move { Ok::<_, Infallible>(serve(&state, request).await) }
                    });
                    let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
                });
            }
        });
        Ok(ApiServer { addr, state, ca_pem, _runtime: runtime })
    }

    fn with<R>(&self, f: impl FnOnce(&mut ApiState) -> R) -> R {
        f(&mut self.state.lock().expect("API state"))
    }

    fn seen(&self) -> Vec<Seen> {
        self.with(|s| s.seen.clone())
    }

    /// A pod the server knows from now on (`gettable`: a direct GET finds it too).
    fn add_pod(&self, pod: Value, gettable: bool) {
        self.with(|s| {
            s.version += 1;
            let mut pod = pod;
            pod["metadata"]["resourceVersion"] = json!(s.version.to_string());
            let line = Bytes::from(format!("{}\n", json!({"type": "ADDED", "object": pod})));
            s.watches.retain(|w| w.send(line.clone()).is_ok());
            s.pods.push((pod, gettable));
        });
    }

    /// The service account directory a pod would have: token, CA, namespace.
    fn service_account(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("token"), TOKEN)?;
        std::fs::write(dir.join("ca.crt"), &self.ca_pem)?;
        std::fs::write(dir.join("namespace"), "vramguard-system")?;
        Ok(())
    }
}

async fn serve(state: &Mutex<ApiState>, request: Request<Incoming>) -> Answer {
    let (parts, body) = request.into_parts();
    let body = body.collect().await.map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned()).unwrap_or_default();
    let authorization = parts.headers.get(AUTHORIZATION).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let target = parts.uri.path_and_query().map(|p| p.as_str().to_owned()).unwrap_or_default();
    let mut state = state.lock().expect("API state");
    state.seen.push(Seen { method: parts.method.to_string(), target, authorization: authorization.clone(), body: body.clone() });
    if authorization.as_deref() != Some(&format!("Bearer {TOKEN}")) {
        return status(StatusCode::UNAUTHORIZED, "Unauthorized", "Unauthorized");
    }
    let query: HashMap<&str, &str> = parts.uri.query().unwrap_or_default().split('&').filter_map(|kv| kv.split_once('=')).collect();
    let segments: Vec<&str> = parts.uri.path().trim_start_matches('/').split('/').collect();
    let version = state.version.to_string();
    match (parts.method.as_str(), segments.as_slice()) {
        ("GET", ["api", "v1", "pods"]) => {
            // The node's pods only, as the field selector asks.
            let selector = query.get("fieldSelector").copied().unwrap_or_default().replace("%3D", "=");
            let Some(node) = selector.strip_prefix("spec.nodeName=") else {
                return status(StatusCode::BAD_REQUEST, "BadRequest", "this server serves the pods of a node");
            };
            if query.get("watch") == Some(&"true") {
                let (sender, receiver) = mpsc::unbounded_channel();
                let bookmark = json!({"type": "BOOKMARK", "object": {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": version}}});
                let _ = sender.send(Bytes::from(format!("{bookmark}\n")));
                state.watches.push(sender);
                return Response::builder().header(CONTENT_TYPE, "application/json").body(Events(receiver).boxed()).expect("a response");
            }
            let items: Vec<Value> = state.pods.iter().map(|(p, _)| p.clone()).filter(|p| p["spec"]["nodeName"] == node).collect();
            answer(StatusCode::OK, &json!({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": version}, "items": items}))
        }
        ("GET", ["api", "v1", "namespaces", namespace, "pods", name]) => {
            let found = state.pods.iter().find(|(p, gettable)| *gettable && p["metadata"]["namespace"] == *namespace && p["metadata"]["name"] == *name);
            match found {
                Some((pod, _)) => answer(StatusCode::OK, pod),
                None => status(StatusCode::NOT_FOUND, "NotFound", &format!("pods \"{name}\" not found")),
            }
        }
        ("GET", ["api", "v1", "nodes", NODE]) => answer(StatusCode::OK, &state.node),
        ("PATCH", ["api", "v1", "nodes", NODE, "status"]) => {
            if parts.headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok()) != Some("application/json-patch+json") {
                return status(StatusCode::UNSUPPORTED_MEDIA_TYPE, "UnsupportedMediaType", "a JSON patch is expected");
            }
            let Ok(ops) = serde_json::from_str::<Vec<Value>>(&body) else {
                return status(StatusCode::BAD_REQUEST, "BadRequest", "not a JSON patch");
            };
            for op in ops {
                let path = op["path"].as_str().unwrap_or_default();
                let Some(key) = path.strip_prefix("/status/capacity/").filter(|_| op["op"] == "add") else {
                    return status(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", "only capacity is patched here");
                };
                state.node["status"]["capacity"][key.replace("~1", "/").replace("~0", "~")] = op["value"].clone();
            }
            answer(StatusCode::OK, &state.node.clone())
        }
        _ => status(StatusCode::NOT_FOUND, "NotFound", "the server could not find the requested resource"),
    }
}

/// A CA and a certificate for 127.0.0.1 signed by it: the server's TLS configuration and the
/// CA's PEM.
fn server_tls() -> Result<(Arc<rustls::ServerConfig>, String)> {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair, SanType};
    let ca_key = KeyPair::generate()?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key)?;
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.subject_alt_names = vec![SanType::IpAddress("127.0.0.1".parse()?)];
    let cert = params.signed_by(&key, &issuer)?;
    let der = rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).map_err(anyhow::Error::msg)?;
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(vec![cert.der().clone()], der)?;
    Ok((Arc::new(config), ca_cert.pem()))
}

/// A pod on this node, as the API server writes it: one container `main` that sets
/// `CUDA_DEVICE_MEMORY_LIMIT=64g` in its env and, with `quota`, limits and requests
/// `vramguard.io/gpu-memory` to it.
fn api_pod(namespace: &str, name: &str, uid: &str, quota: Option<&str>) -> Value {
    let mut container = json!({
        "name": "main",
        "image": "registry.example/ml/train:3.1",
        "env": [{"name": "CUDA_DEVICE_MEMORY_LIMIT", "value": "64g"}],
        "resources": {},
        "terminationMessagePath": "/dev/termination-log",
        "imagePullPolicy": "IfNotPresent"
    });
    if let Some(quota) = quota {
        container["resources"] = json!({"limits": {RESOURCE: quota}, "requests": {RESOURCE: quota}});
    }
    json!({
        "kind": "Pod", "apiVersion": "v1",
        "metadata": {"name": name, "namespace": namespace, "uid": uid, "creationTimestamp": "2026-11-26T15:00:00Z"},
        "spec": {"containers": [container], "nodeName": NODE, "restartPolicy": "Never", "schedulerName": "default-scheduler"},
        "status": {"phase": "Pending", "qosClass": "BestEffort"}
    })
}

/// Allocations that fit a 1 GiB quota with one 518 MiB context (256 MiB) and one that does
/// not (512 MiB more).
const OVER: [&str; 4] = ["ctx 0", "alloc a 256m", "expect-oom alloc b 512m", "meminfo"];

fn run_workload(containerd: &Containerd, container: &ContainerId, env: &[&str]) -> Result<Vec<String>> {
    let workload = workload_path();
    let argv: Vec<&str> = ["env"].into_iter().chain(env.iter().copied()).chain([workload.as_str()]).chain(OVER).collect();
    let out = containerd.exec_sync(container, &argv)?;
    ensure!(out.exit_code == 0, "{argv:?} in the container: {out:?}");
    Ok(out.stdout.lines().map(str::to_owned).collect())
}

#[test]
fn the_quota_comes_from_the_pod_spec_through_the_api_and_the_capacity_is_published() -> Result<()> {
    let api = ApiServer::start()?;
    let dir = TempDir::new("kube-quota")?;
    let account = dir.path().join("serviceaccount");
    api.service_account(&account)?;
    std::fs::create_dir_all(dir.path().join("ledgers"))?;
    // The pod without the resource is there from the start (the agent's list has it).
    api.add_pod(api_pod("team-b", "web", "uid-kube-b", None), true);

    let fake = FakeNode::new("kube-quota").with_env("FAKECUDA_DEVICE_BYTES", "8g").with_env("FAKECUDA_CONTEXT_BYTES", "518m");
    let containerd = Containerd::start(&dir.path().join("nri.sock"))?;
    let libcuda = e2e::fake_driver_dir()?.join("libcuda.so.1");
    let args: Vec<OsString> = vec![
        "--libcuda".into(),
        libcuda.into(),
        "--no-discover".into(),
        "--ledger-dir".into(),
        dir.path().join("ledgers").into(),
        "--metrics-addr".into(),
        "127.0.0.1:0".into(),
        "--nri".into(),
        "--nri-socket".into(),
        dir.path().join("nri.sock").into(),
        "--state-dir".into(),
        dir.path().join("state").into(),
        "--hook-library".into(),
        e2e::hook_lib()?.into(),
        "--gpu-memory".into(),
        "8g".into(),
        "--kube".into(),
    ];
    // As the DaemonSet's pod has them: the service's address, the node's name, and (here
    // only) where the service account's files are.
    let env: Vec<(OsString, OsString)> = vec![
        ("KUBERNETES_SERVICE_HOST".into(), "127.0.0.1".into()),
        ("KUBERNETES_SERVICE_PORT".into(), api.addr.port().to_string().into()),
        ("NODE_NAME".into(), NODE.into()),
        ("VRAMGUARD_KUBE_SERVICE_ACCOUNT_DIR".into(), account.clone().into()),
    ];
    let args: Vec<&OsStr> = args.iter().map(OsString::as_os_str).collect();
    let agent = Agent::start_with_env(&args, &env)?;
    wait_for(timeout(), "the agent registered with containerd", || Ok(agent.audit()?["nri_connected"] == true))
        .with_context(|| agent.log())?;
    wait_for(timeout(), "the agent watching the node's pods", || Ok(api.with(|s| !s.watches.is_empty()))).with_context(|| agent.log())?;

    // The node's capacity: the 8 GiB GPU, through the status subresource.
    wait_for(timeout(), "the node's capacity published", || Ok(api.with(|s| s.node["status"]["capacity"][RESOURCE] == "8589934592")))
        .with_context(|| agent.log())?;
    let seen = api.seen();
    let patch = seen.iter().find(|r| r.method == "PATCH").context("no PATCH")?;
    ensure!(patch.target.starts_with(&format!("/api/v1/nodes/{NODE}/status")), "{patch:?}");
    ensure!(patch.body.contains(r#""path":"/status/capacity/vramguard.io~1gpu-memory""#), "{patch:?}");
    let list = seen.iter().find(|r| r.target.starts_with("/api/v1/pods?") && !r.target.contains("watch=")).context("no list")?;
    ensure!(list.target.contains(&format!("fieldSelector=spec.nodeName%3D{NODE}")), "{list:?}");

    // The pod with the quota reaches the agent through the watch only.
    api.add_pod(api_pod("team-a", "trainer", "uid-kube-a", Some("1Gi")), false);
    // (The event is on a loopback connection the agent reads at once; this only leaves it
    // the moment to, before the runtime asks about the pod.)
    std::thread::sleep(Duration::from_secs(1));
    let spec = || -> Result<ContainerSpec> { ContainerSpec::new("main").env("CUDA_DEVICE_MEMORY_LIMIT", "64g").fake_driver(&fake) };
    let pod = containerd.pod("trainer", "team-a", "uid-kube-a", &[])?;
    let main = containerd.run_container(&pod, &spec()?)?;
    let env = containerd.container_env(&main)?;
    ensure!(env.contains(&format!("CUDA_DEVICE_MEMORY_LIMIT={GIB}")), "the agent's value replaces the spec's: {env:?}");
    ensure!(env.iter().any(|e| e == "VRAMGUARD_LEDGER=/run/vramguard/ledger"), "{env:?}");
    let audit = agent.audit()?;
    let record = audit["provisioned"].as_array().and_then(|rows| rows.iter().find(|r| r["container_id"] == main.0.as_str()).cloned());
    let record = record.context("the agent has no record of the container")?;
    ensure!(record["quota"] == GIB && record["source"] == "kubernetes", "{record}");
    ensure!(!api.seen().iter().any(|r| r.target.starts_with("/api/v1/namespaces/team-a/pods/trainer")), "a GET of the pod: the quota must have come from the watch");
    for lines in [run_workload(&containerd, &main, &[])?, run_workload(&containerd, &main, &["CUDA_DEVICE_MEMORY_LIMIT=64g"])?] {
        ensure!(lines.iter().any(|l| l == "oom b"), "past 1 GiB must be refused: {lines:?}");
        let meminfo = lines.iter().find(|l| l.starts_with("meminfo")).context("no meminfo line")?;
        ensure!(meminfo.contains(&format!("total={GIB}")), "the quota is the GPU the workload sees: {meminfo}");
    }

    // Negative control: the same environment, no resource: untouched.
    let pod = containerd.pod("web", "team-b", "uid-kube-b", &[])?;
    let web = containerd.run_container(&pod, &spec()?)?;
    let env = containerd.container_env(&web)?;
    ensure!(!env.iter().any(|e| e.starts_with("VRAMGUARD_")), "{env:?}");
    ensure!(env.iter().any(|e| e == "CUDA_DEVICE_MEMORY_LIMIT=64g"), "its own value, unchanged: {env:?}");
    let mounts = containerd.container_mounts(&web)?;
    let injected = |dest: &str| dest.starts_with("/run/vramguard") || dest.starts_with("/usr/lib/vramguard") || dest == "/etc/ld.so.preload";
    ensure!(!mounts.iter().any(|(dest, _, _)| injected(dest)), "{mounts:?}");
    let audit = agent.audit()?;
    ensure!(!audit["provisioned"].as_array().is_some_and(|rows| rows.iter().any(|r| r["container_id"] == web.0.as_str())), "no record for it");
    ensure!(api.seen().iter().all(|r| r.authorization.as_deref() == Some(&format!("Bearer {TOKEN}"))), "every request carries the token");
    drop(agent);
    fake.cleanup();
    Ok(())
}
