//! A small Kubernetes API server for the end-to-end tests (`kube_quota.rs`, `kube_down.rs`):
//! TLS on a loopback port with a CA of its own, one node and its pods, serving them as the
//! real one writes them (a list and a watch with a field selector on the node, a GET of a
//! pod, the node and a JSON patch of its status), and recording every request. It can be
//! made to fail as a real one does on a bad minute ([`Mode`]): every request answered 500,
//! every request left unanswered, or no longer listening (connections refused); each change
//! cuts the connections open at the time (the agent's watch and its pooled connections).
#![allow(dead_code)]
use std::{
    collections::HashMap,
    convert::Infallible,
    ffi::{OsStr, OsString},
    net::SocketAddr,
    path::Path,
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context as TaskContext, Poll},
};

use anyhow::{Context as _, Result};
use bytes::Bytes;
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
use e2e::{agent::Agent, timeout, wait_for};
use tokio::{sync::mpsc, task::AbortHandle};

pub mod objects;
pub mod resource;
pub mod templates;

pub const NODE: &str = "gpu-node-7";
pub const TOKEN: &str = "e2e-service-account-token";
pub const RESOURCE: &str = "vramguard.io/gpu-memory";

/// A request the API server received.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: String,
    pub target: String,
    pub authorization: Option<String>,
    pub body: String,
}

/// How the server answers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Mode {
    /// As a working API server.
    #[default]
    Up,
    /// Every request answered `500 Internal Server Error`.
    Failing,
    /// Every request accepted and never answered.
    Hanging,
    /// Not listening: connections refused (for good).
    Refusing,
}

#[derive(Default)]
pub struct ApiState {
    pub seen: Vec<Seen>,
    /// Every pod the server knows, with whether a direct GET finds it (false: only the watch
    /// tells of it).
    pub pods: Vec<(Value, bool)>,
    pub node: Value,
    pub watches: Vec<mpsc::UnboundedSender<Bytes>>,
    pub version: u64,
    pub mode: Mode,
    /// resource.k8s.io/v1 ([`resource`]): ResourceClaims (with their allocation), the
    /// driver's ResourceSlices, DeviceClasses.
    pub resource: resource::Resources,
    /// ResourceClaimTemplates by (namespace, name) ([`templates`]: the admission webhook's).
    pub templates: std::collections::BTreeMap<(String, String), Value>,
    /// Secrets and MutatingWebhookConfigurations ([`objects`]: the admission webhook's
    /// certificate and its caBundle).
    pub objects: std::collections::BTreeMap<objects::Key, Value>,
    /// Writes of another writer, stored just before the next write to their name ([`objects`]).
    pub interpose: Vec<(objects::Key, Value)>,
    /// The connections being served, to cut when the mode changes.
    connections: Vec<AbortHandle>,
    /// The listener's task (aborted: connections refused).
    listener: Option<AbortHandle>,
}

/// The API server: TLS on a loopback port with its own CA, one node and its pods.
pub struct ApiServer {
    pub addr: SocketAddr,
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

pub(crate) type Answer = Response<BoxBody<Bytes, Infallible>>;

pub(crate) fn answer(status: StatusCode, value: &Value) -> Answer {
    Response::builder()
        .status(status)
        .header(CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(value.to_string())).boxed())
        .expect("a response")
}

pub(crate) fn status(code: StatusCode, reason: &str, message: &str) -> Answer {
    let body = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message, "reason": reason, "code": code.as_u16()});
    answer(code, &body)
}

impl ApiServer {
    pub fn start() -> Result<ApiServer> {
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
        let listening = runtime.spawn(async move {
            let acceptor = tokio_rustls::TlsAcceptor::from(tls);
            while let Ok((tcp, _)) = listener.accept().await {
                let (acceptor, state) = (acceptor.clone(), served.clone());
                let connection = tokio::spawn(async move {
                    let Ok(stream) = acceptor.accept(tcp).await else { return };
                    let service = service_fn(move |request| {
                        let state = state.clone();
                        async move { Ok::<_, Infallible>(serve(&state, request).await) }
                    });
                    let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
                });
                let mut state = served.lock().expect("API state");
                state.connections.retain(|c| !c.is_finished());
                state.connections.push(connection.abort_handle());
            }
        });
        state.lock().map_err(|_| anyhow::anyhow!("API state poisoned"))?.listener = Some(listening.abort_handle());
        Ok(ApiServer { addr, state, ca_pem, _runtime: runtime })
    }

    pub fn with<R>(&self, f: impl FnOnce(&mut ApiState) -> R) -> R {
        f(&mut self.state.lock().expect("API state"))
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.with(|s| s.seen.clone())
    }

    /// A pod the server knows from now on (`gettable`: a direct GET finds it too).
    pub fn add_pod(&self, pod: Value, gettable: bool) {
        self.with(|s| {
            s.version += 1;
            let mut pod = pod;
            pod["metadata"]["resourceVersion"] = json!(s.version.to_string());
            let line = Bytes::from(format!("{}\n", json!({"type": "ADDED", "object": pod})));
            s.watches.retain(|w| w.send(line.clone()).is_ok());
            s.pods.push((pod, gettable));
        });
    }

    /// Answers as `mode` from now on, the connections open now cut (the watch with them).
    pub fn set_mode(&self, mode: Mode) {
        self.with(|s| {
            s.mode = mode;
            s.watches.clear();
            for connection in s.connections.drain(..) {
                connection.abort();
            }
            if mode == Mode::Refusing {
                if let Some(listener) = s.listener.take() {
                    listener.abort();
                }
            }
        });
    }

    /// An agent on the fake driver of `fake` (its NVML sees that node's GPUs) as containerd's
    /// NRI plugin (its socket `<dir>/nri.sock`, its state `<dir>/state`, ledgers under
    /// `<dir>/ledgers`) with `--kube` alone for quotas, reaching this server as the
    /// DaemonSet's pod does (the service's address, the node's name, the service account's
    /// files in `account`), and `more` arguments; returned once it is registered with
    /// containerd.
    pub fn agent(&self, fake: &e2e::FakeNode, dir: &Path, account: &Path, more: &[&str]) -> Result<Agent> {
        let mut args = e2e::agent::kube_node_args(dir, "8g")?;
        args.extend(more.iter().map(OsString::from));
        let mut env = self.pod_env(account);
        env.extend(fake.env().iter().cloned());
        let args: Vec<&OsStr> = args.iter().map(OsString::as_os_str).collect();
        let agent = Agent::start_with_env(&args, &env)?;
        wait_for(timeout(), "the agent registered with containerd", || Ok(agent.audit()?["nri_connected"] == true))
            .with_context(|| agent.log())?;
        Ok(agent)
    }

    /// The environment the DaemonSet's pod gives the agent to reach this server: the
    /// service's address, the node's name, and the service account's files in `account`.
    pub fn pod_env(&self, account: &Path) -> Vec<(OsString, OsString)> {
        vec![
            ("KUBERNETES_SERVICE_HOST".into(), "127.0.0.1".into()),
            ("KUBERNETES_SERVICE_PORT".into(), self.addr.port().to_string().into()),
            ("NODE_NAME".into(), NODE.into()),
            ("VRAMGUARD_KUBE_SERVICE_ACCOUNT_DIR".into(), account.into()),
        ]
    }

    /// The service account directory a pod would have: token, CA, namespace.
    pub fn service_account(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("token"), TOKEN)?;
        std::fs::write(dir.join("ca.crt"), &self.ca_pem)?;
        std::fs::write(dir.join("namespace"), "vramguard-system")?;
        Ok(())
    }
}

async fn serve(state: &Mutex<ApiState>, request: Request<Incoming>) -> Answer {
    let mode = state.lock().expect("API state").mode;
    match mode {
        Mode::Failing => return status(StatusCode::INTERNAL_SERVER_ERROR, "InternalError", "etcdserver: request timed out"),
        Mode::Hanging => std::future::pending::<()>().await,
        Mode::Up | Mode::Refusing => {}
    }
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
                // As the real one: the changes since the version the watch starts from first.
                let since: u64 = query.get("resourceVersion").and_then(|v| v.parse().ok()).unwrap_or(u64::MAX);
                for (pod, _) in state.pods.iter().filter(|(p, _)| p["spec"]["nodeName"] == node) {
                    let version: u64 = pod["metadata"]["resourceVersion"].as_str().and_then(|v| v.parse().ok()).unwrap_or(0);
                    if version > since {
                        let _ = sender.send(Bytes::from(format!("{}\n", json!({"type": "ADDED", "object": pod}))));
                    }
                }
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
                let Some(key) = path.strip_prefix("/status/capacity/").map(|k| k.replace("~1", "/").replace("~0", "~")) else {
                    return status(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", "only capacity is patched here");
                };
                let capacity = &mut state.node["status"]["capacity"];
                match op["op"].as_str() {
                    Some("add") => capacity[key] = op["value"].clone(),
                    // As RFC 6902 says: removing what is not there fails the whole patch.
                    Some("remove") => match capacity.as_object_mut().and_then(|c| c.remove(&key)) {
                        Some(_) => {}
                        None => return status(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", &format!("the path {path} does not exist")),
                    },
                    _ => return status(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", "only add and remove are served here"),
                }
            }
            answer(StatusCode::OK, &state.node.clone())
        }
        (method, ["api", "v1", "namespaces", namespace, "secrets", rest @ ..]) => {
            let content_type = parts.headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok());
            objects::serve(&mut state, &objects::SECRETS, (method, content_type), namespace, rest, &body)
        }
        (method, ["apis", "admissionregistration.k8s.io", "v1", "mutatingwebhookconfigurations", rest @ ..]) => {
            let content_type = parts.headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok());
            objects::serve(&mut state, &objects::WEBHOOK_CONFIGURATIONS, (method, content_type), "", rest, &body)
        }
        (method, ["apis", "resource.k8s.io", "v1", "namespaces", namespace, "resourceclaimtemplates", rest @ ..]) => {
            templates::serve(&mut state, method, namespace, rest, &body)
        }
        (method, ["apis", "resource.k8s.io", "v1", rest @ ..]) => {
            let asked = resource::Asked { method, rest, query: &query, body: &body };
            resource::serve(&mut state, asked).unwrap_or_else(|| status(StatusCode::NOT_FOUND, "NotFound", "the server could not find the requested resource"))
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
pub fn api_pod(namespace: &str, name: &str, uid: &str, quota: Option<&str>) -> Value {
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

