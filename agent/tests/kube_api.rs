//! The Kubernetes API side of provisioning (`agent::provision::kube`) against a mock API
//! server: a hyper server in the test serving objects shaped as the API server writes them
//! (`fixtures/kube/`: pods, a node, `Status` answers) and recording every request it gets.
use std::{
    collections::HashMap,
    convert::Infallible,
    net::SocketAddr,
    path::{Path, PathBuf},
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
    time::{Duration, Instant},
};

use agent::provision::kube::{patch_body, Capacity, Client, KubeConfig, KubeError, Known, PodCache, Tuning, JSON_PATCH, REMEMBERED};
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
use tokio::{net::TcpListener, sync::mpsc};

const NODE: &str = "node-a";
const TRAINER_UID: &str = "6f1c2d3e-4b5a-4c6d-8e7f-9a0b1c2d3e4f";
const MIRROR_UID: &str = "0d9e8f7a-6b5c-4d3e-2f1a-0b9c8d7e6f5a";
const STATIC_UID: &str = "3c1b9a0e5f7d2468ace13579bdf02468";
const LATE_UID: &str = "b7e4c1a0-2d3f-4e5a-9b8c-7d6e5f4a3b2c";
const GI: u64 = 1 << 30;

fn fixture(name: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kube").join(name);
    serde_json::from_slice(&std::fs::read(&path).expect("fixture")).expect("fixture JSON")
}

/// A request the mock received.
#[derive(Clone, Debug)]
struct Recorded {
    method: String,
    /// Path and query.
    target: String,
    authorization: Option<String>,
    content_type: Option<String>,
    body: Vec<u8>,
}

#[derive(Default)]
struct MockState {
    requests: Vec<Recorded>,
    /// The pods a list returns (in order) and the list's resourceVersion.
    listed: Vec<Value>,
    list_version: String,
    /// The pods a direct GET finds, by (namespace, name).
    pods: HashMap<(String, String), Value>,
    node: Value,
    /// Watches to answer with HTTP 410 before serving one.
    watches_gone: usize,
    /// Requests to answer with HTTP 401 before serving one.
    unauthorized: usize,
    /// The open watches' event senders, oldest first.
    watches: Vec<mpsc::UnboundedSender<Bytes>>,
}

#[derive(Clone)]
struct Mock {
    addr: SocketAddr,
    state: Arc<Mutex<MockState>>,
}

/// A response body fed by the test, one chunk at a time (a watch).
struct ChannelBody(mpsc::UnboundedReceiver<Bytes>);

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|chunk| chunk.map(|c| Ok(Frame::data(c))))
    }
}

type Answer = Response<BoxBody<Bytes, Infallible>>;

fn json_answer(status: StatusCode, value: &Value) -> Answer {
    Response::builder()
        .status(status)
        .header(CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(value.to_string())).boxed())
        .expect("response")
}

fn not_found(name: &str) -> Answer {
    let status = fixture("status-not-found.json").to_string().replace("NAME", name);
    json_answer(StatusCode::NOT_FOUND, &serde_json::from_str(&status).expect("status"))
}

impl Mock {
    /// Serves on a loopback port, over TLS when `tls` is given.
    async fn start(tls: Option<Arc<rustls::ServerConfig>>) -> Mock {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let state = Arc::new(Mutex::new(MockState {
            list_version: "48400".into(),
            node: fixture("node.json"),
            ..MockState::default()
        }));
        let mock = Mock { addr, state };
        let server = mock.clone();
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else { return };
                let mock = server.clone();
                let tls = tls.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |request| {
                        let mock = mock.clone();
                        async move { Ok::<_, Infallible>(mock.answer(request).await) }
                    });
                    match tls {
                        Some(config) => {
                            let Ok(stream) = tokio_rustls::TlsAcceptor::from(config).accept(tcp).await else { return };
                            let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
                        }
                        None => {
                            let _ = http1::Builder::new().serve_connection(TokioIo::new(tcp), service).await;
                        }
                    }
                });
            }
        });
        mock
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn with<R>(&self, f: impl FnOnce(&mut MockState) -> R) -> R {
        f(&mut self.state.lock().expect("mock state"))
    }

    fn requests(&self) -> Vec<Recorded> {
        self.with(|s| s.requests.clone())
    }

    fn count(&self, pred: impl Fn(&Recorded) -> bool) -> usize {
        self.requests().iter().filter(|r| pred(r)).count()
    }

    /// Sends one event on the newest open watch.
    fn event(&self, kind: &str, object: Value) {
        let line = format!("{}\n", json!({ "type": kind, "object": object }));
        self.with(|s| s.watches.last().expect("an open watch").send(Bytes::from(line)).expect("watch open"));
    }

    /// Ends every open watch, as the server does when its timeout passes.
    fn end_watches(&self) {
        self.with(|s| s.watches.clear());
    }

    async fn answer(&self, request: Request<Incoming>) -> Answer {
        let (parts, body) = request.into_parts();
        let body = body.collect().await.map(|b| b.to_bytes().to_vec()).unwrap_or_default();
        let header = |name| parts.headers.get(name).and_then(|v: &hyper::header::HeaderValue| v.to_str().ok()).map(str::to_owned);
        let target = parts.uri.path_and_query().map(|p| p.as_str().to_owned()).unwrap_or_default();
        let recorded = Recorded {
            method: parts.method.to_string(),
            target: target.clone(),
            authorization: header(AUTHORIZATION),
            content_type: header(CONTENT_TYPE),
            body,
        };
        let mut state = self.state.lock().expect("mock state");
        state.requests.push(recorded.clone());
        if state.unauthorized > 0 {
            state.unauthorized -= 1;
            let status = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": "Unauthorized", "reason": "Unauthorized", "code": 401});
            return json_answer(StatusCode::UNAUTHORIZED, &status);
        }
        let path = parts.uri.path();
        let query: HashMap<&str, &str> =
            parts.uri.query().unwrap_or_default().split('&').filter_map(|kv| kv.split_once('=')).collect();
        let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        match (recorded.method.as_str(), segments.as_slice()) {
            // kube's watcher says `watch=true`.
            ("GET", ["api", "v1", "pods"]) if matches!(query.get("watch"), Some(&"1" | &"true")) => {
                if state.watches_gone > 0 {
                    state.watches_gone -= 1;
                    return json_answer(StatusCode::GONE, &fixture("status-gone.json"));
                }
                let (sender, receiver) = mpsc::unbounded_channel();
                state.watches.push(sender);
                Response::builder()
                    .header(CONTENT_TYPE, "application/json")
                    .body(ChannelBody(receiver).boxed())
                    .expect("response")
            }
            ("GET", ["api", "v1", "pods"]) => {
                // Pages of `limit` pods, continued by an opaque token (with characters that
                // need encoding in a query).
                let limit: usize = query.get("limit").and_then(|l| l.parse().ok()).unwrap_or(usize::MAX);
                let offset: usize = query
                    .get("continue")
                    .map(|c| c.trim_start_matches("c%2B").trim_end_matches("%3D").parse().expect("continue token"))
                    .unwrap_or(0);
                let items: Vec<Value> = state.listed.iter().skip(offset).take(limit).cloned().map(as_list_item).collect();
                let next = offset + items.len();
                let mut metadata = json!({ "resourceVersion": state.list_version });
                if next < state.listed.len() {
                    metadata["continue"] = json!(format!("c+{next}="));
                }
                json_answer(StatusCode::OK, &json!({ "kind": "PodList", "apiVersion": "v1", "metadata": metadata, "items": items }))
            }
            ("GET", ["api", "v1", "namespaces", namespace, "pods", name]) => {
                match state.pods.get(&(namespace.to_string(), name.to_string())) {
                    Some(pod) => json_answer(StatusCode::OK, pod),
                    None => not_found(name),
                }
            }
            ("GET", ["api", "v1", "nodes", NODE]) => json_answer(StatusCode::OK, &state.node),
            ("PATCH", ["api", "v1", "nodes", NODE, "status"]) => {
                let ops: Vec<Value> = serde_json::from_slice(&recorded.body).expect("a JSON patch");
                for op in ops {
                    let key = op["path"].as_str().expect("path").trim_start_matches("/status/capacity/").replace("~1", "/");
                    state.node["status"]["capacity"][key] = op["value"].clone();
                }
                let node = state.node.clone();
                json_answer(StatusCode::OK, &node)
            }
            _ => not_found(path),
        }
    }
}

/// A pod as a list carries it: without `kind` and `apiVersion`.
fn as_list_item(mut pod: Value) -> Value {
    if let Some(object) = pod.as_object_mut() {
        object.remove("kind");
        object.remove("apiVersion");
    }
    pod
}

fn key(pod: &Value) -> (String, String) {
    let meta = &pod["metadata"];
    (meta["namespace"].as_str().expect("ns").into(), meta["name"].as_str().expect("name").into())
}

fn tuning() -> Tuning {
    Tuning {
        backoff_min: Duration::from_millis(20),
        backoff_max: Duration::from_millis(200),
        page_size: 1,
        ..Tuning::default()
    }
}

fn client(url: &str, token: Option<PathBuf>, ca: Option<PathBuf>) -> Client {
    KubeConfig::explicit(url, token, ca).expect("config").client().expect("client")
}

/// Waits (at most 10 s) until `check` holds.
async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let start = Instant::now();
    while !check() {
        assert!(start.elapsed() < Duration::from_secs(10), "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn is_list(r: &Recorded) -> bool {
    r.target.starts_with("/api/v1/pods?") && !is_watch(r)
}

fn is_watch(r: &Recorded) -> bool {
    r.target.starts_with("/api/v1/pods?") && r.target.split(['?', '&']).any(|kv| kv == "watch=true" || kv == "watch=1")
}

/// A request's query parameters, sorted, as they were sent (encoded).
fn params(r: &Recorded) -> Vec<&str> {
    let mut params: Vec<&str> = r.target.split_once('?').map(|(_, q)| q).unwrap_or_default().split('&').filter(|p| !p.is_empty()).collect();
    params.sort_unstable();
    params
}

fn path(r: &Recorded) -> &str {
    r.target.split_once('?').map_or(&r.target, |(path, _)| path)
}

fn is_pod_get(r: &Recorded) -> bool {
    r.target.starts_with("/api/v1/namespaces/")
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vramguard-kube-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

#[tokio::test]
async fn quotas_come_from_the_listed_pods() {
    let mock = Mock::start(None).await;
    mock.with(|s| s.listed = vec![fixture("pod-trainer.json"), fixture("pod-static-mirror.json")]);
    let cache = PodCache::start_with(client(&mock.url(), None, None), NODE, tuning()).expect("start");
    eventually("the first list", || cache.state().synced()).await;
    assert!(cache.state().connected());
    assert_eq!(cache.state().pods(), 2);

    // Two pages (page size 1), the second continued by the first's token, both selecting
    // this node's pods.
    let lists: Vec<_> = mock.requests().into_iter().filter(is_list).collect();
    assert_eq!(lists.len(), 2, "{lists:?}");
    // (kube writes `?&` before the first parameter: the parameters are compared, not the text.)
    assert_eq!(params(&lists[0]), ["fieldSelector=spec.nodeName%3Dnode-a", "limit=1"]);
    assert_eq!(params(&lists[1]), ["continue=c%2B1%3D", "fieldSelector=spec.nodeName%3Dnode-a", "limit=1"]);

    let quota = |ns: &'static str, pod: &'static str, uid: &'static str, container: &'static str| {
        let cache = cache.clone();
        async move { cache.container_quota(ns, pod, uid, container).await }
    };
    assert_eq!(quota("ml", "trainer", TRAINER_UID, "main").await.expect("main"), Some(8 * GI));
    assert_eq!(quota("ml", "trainer", TRAINER_UID, "sidecar").await.expect("sidecar"), None);
    assert_eq!(quota("ml", "trainer", TRAINER_UID, "warmup").await.expect("init container"), Some(GI));
    // A static pod: the runtime knows it by the kubelet's UID, which its mirror carries.
    assert_eq!(quota("kube-system", "gpu-probe-node-a", STATIC_UID, "probe").await.expect("static"), Some(512 << 20));
    assert_eq!(quota("kube-system", "gpu-probe-node-a", MIRROR_UID, "probe").await.expect("mirror"), Some(512 << 20));
    assert_eq!(mock.count(is_pod_get), 0, "every answer so far came from the cache");

    // Another pod of the same name (a StatefulSet's replacement): not this one. The cache
    // does not have it, so the API server is asked, and it has only the old one.
    mock.with(|s| s.pods.insert(("ml".into(), "trainer".into()), fixture("pod-trainer.json")));
    let other = quota("ml", "trainer", "00000000-0000-4000-8000-000000000000", "main").await;
    assert!(matches!(other, Err(KubeError::PodNotFound { .. })), "{other:?}");
    assert_eq!(mock.count(is_pod_get), 1);
    // A container the pod does not have.
    let none = quota("ml", "trainer", TRAINER_UID, "ghost").await;
    assert!(matches!(none, Err(KubeError::NoContainer { .. })), "{none:?}");
}

#[tokio::test]
async fn the_watch_picks_up_pods_created_after_start() {
    let mock = Mock::start(None).await;
    let cache = PodCache::start_with(client(&mock.url(), None, None), NODE, tuning()).expect("start");
    eventually("a watch", || mock.with(|s| !s.watches.is_empty())).await;
    let watch = mock.requests().into_iter().find(is_watch).expect("watch request");
    assert!(watch.target.contains("fieldSelector=spec.nodeName%3Dnode-a"), "{}", watch.target);
    assert!(watch.target.contains("resourceVersion=48400"), "resumes from the list's version: {}", watch.target);
    assert!(params(&watch).contains(&"allowWatchBookmarks=true"), "bookmarks asked for: {}", watch.target);

    // Not known before its event (the API server's GET does not have it either).
    let before = cache.container_quota("ml", "late-job-7xq2m", LATE_UID, "job").await;
    assert!(matches!(before, Err(KubeError::PodNotFound { .. })), "{before:?}");
    mock.event("ADDED", fixture("pod-late.json"));
    eventually("the ADDED pod", || cache.state().pods() == 1).await;
    let gets = mock.count(is_pod_get);
    assert_eq!(cache.container_quota("ml", "late-job-7xq2m", LATE_UID, "job").await.expect("late"), Some(3 * GI / 2));
    assert_eq!(mock.count(is_pod_get), gets, "answered from the cache");

    // A bookmark moves the version on; a watch the server ends resumes from it, no relist.
    mock.event("ADDED", json!({"kind": "Pod", "apiVersion": "v1", "metadata": {"name": "x", "namespace": "y", "uid": "z", "resourceVersion": "48500"}, "spec": {"nodeName": NODE, "containers": [{"name": "c"}]}}));
    mock.event("BOOKMARK", json!({"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": "48999", "creationTimestamp": null}, "spec": {"containers": null}, "status": {}}));
    eventually("the second pod", || cache.state().pods() == 2).await;
    mock.end_watches();
    eventually("a second watch", || mock.count(is_watch) == 2).await;
    let rewatch = mock.requests().into_iter().filter(is_watch).nth(1).expect("second watch");
    assert!(rewatch.target.contains("resourceVersion=48999"), "{}", rewatch.target);
    assert_eq!(cache.state().lists(), 1, "no relist after a watch that simply ended");

    // DELETED takes it out of the cache: the lookup goes to the API server, which says 404.
    eventually("the watch open", || mock.with(|s| !s.watches.is_empty())).await;
    mock.event("DELETED", fixture("pod-late.json"));
    eventually("the DELETED pod", || cache.state().pods() == 1).await;
    let after = cache.container_quota("ml", "late-job-7xq2m", LATE_UID, "job").await;
    assert!(matches!(after, Err(KubeError::PodNotFound { .. })), "{after:?}");
}

#[tokio::test]
async fn a_410_gone_relists() {
    let mock = Mock::start(None).await;
    mock.with(|s| s.listed = vec![fixture("pod-trainer.json")]);
    let cache = PodCache::start_with(client(&mock.url(), None, None), NODE, tuning()).expect("start");
    eventually("a watch", || mock.with(|s| !s.watches.is_empty())).await;
    assert_eq!(cache.state().lists(), 1);

    // In the stream: an ERROR event carrying the 410 Status. Meanwhile a pod appeared that
    // the old watch never told of; the relist brings it.
    mock.with(|s| {
        s.listed.push(fixture("pod-late.json"));
        s.list_version = "49001".into();
    });
    mock.event("ERROR", fixture("status-gone.json"));
    eventually("a relist", || cache.state().lists() == 2).await;
    assert_eq!(cache.container_quota("ml", "late-job-7xq2m", LATE_UID, "job").await.expect("relisted"), Some(3 * GI / 2));
    assert_eq!(mock.count(is_pod_get), 0, "from the relisted cache");
    eventually("a watch from the new list", || {
        mock.requests().iter().any(|r| is_watch(r) && r.target.contains("resourceVersion=49001"))
    })
    .await;

    // As the watch request's own answer: HTTP 410.
    mock.with(|s| s.watches_gone = 1);
    mock.end_watches();
    eventually("another relist", || cache.state().lists() == 3).await;
    assert_eq!(cache.state().pods(), 2);
}

#[tokio::test]
async fn a_pod_not_cached_yet_is_fetched_directly() {
    let mock = Mock::start(None).await;
    let late = fixture("pod-late.json");
    mock.with(|s| s.pods.insert(key(&late), late));
    let cache = PodCache::start_with(client(&mock.url(), None, None), NODE, tuning()).expect("start");
    // Whether or not the first list has completed: the pod is in no list.
    assert_eq!(cache.container_quota("ml", "late-job-7xq2m", LATE_UID, "job").await.expect("GET"), Some(3 * GI / 2));
    let gets: Vec<_> = mock.requests().into_iter().filter(is_pod_get).collect();
    assert_eq!(gets.len(), 1);
    assert_eq!((gets[0].method.as_str(), path(&gets[0])), ("GET", "/api/v1/namespaces/ml/pods/late-job-7xq2m"));
    assert!(params(&gets[0]).is_empty(), "{}", gets[0].target);
    // Names that are not Kubernetes names never reach a path.
    let bad = cache.container_quota("ml", "../nodes/node-a", LATE_UID, "job").await;
    assert!(matches!(bad, Err(KubeError::BadName { .. })), "{bad:?}");
    assert_eq!(mock.count(is_pod_get), 1);
}

#[tokio::test]
async fn the_node_capacity_is_patched_and_reasserted() {
    let mock = Mock::start(None).await;
    let every = Duration::from_millis(50);
    // The node's GPUs: none known yet (NVML not read), then NVML's two.
    let (gpus, inventory) = tokio::sync::watch::channel(None);
    let capacity = Capacity::start(client(&mock.url(), None, None), NODE, inventory, 1.0, every).expect("start");
    let is_patch = |r: &Recorded| r.method == "PATCH";
    tokio::time::sleep(every * 4).await;
    assert_eq!(mock.count(|_| true), 0, "nothing is advertised before the inventory has a GPU");
    assert!(!capacity.state().asserted());
    gpus.send_replace(Some(std::sync::Arc::new(agent::inventory::from_flag(&[80 * GI, 80 * GI], 0))));
    eventually("the first patch", || mock.count(is_patch) == 1).await;
    let patch = mock.requests().into_iter().find(is_patch).expect("patch");
    assert_eq!(path(&patch), "/api/v1/nodes/node-a/status");
    assert_eq!(params(&patch), ["fieldManager=vramguard"]);
    assert_eq!(patch.content_type.as_deref(), Some("application/json-patch+json"));
    assert_eq!(JSON_PATCH, "application/json-patch+json");
    assert_eq!(
        String::from_utf8(patch.body.clone()).expect("utf-8"),
        r#"[{"op":"add","path":"/status/capacity/vramguard.io~1gpu-memory","value":"171798691840"}]"#
    );
    assert_eq!(patch.body, patch_body(160 * GI));
    assert_eq!(mock.with(|s| s.node["status"]["capacity"]["vramguard.io/gpu-memory"].clone()), json!("171798691840"));
    eventually("asserted", || capacity.state().asserted()).await;

    // Unchanged, or the same value written another way: checked, not patched.
    let gets = mock.count(|r| r.method == "GET");
    eventually("three more checks", || mock.count(|r| r.method == "GET") >= gets + 3).await;
    mock.with(|s| s.node["status"]["capacity"]["vramguard.io/gpu-memory"] = json!("160Gi"));
    let gets = mock.count(|r| r.method == "GET");
    eventually("three more checks", || mock.count(|r| r.method == "GET") >= gets + 3).await;
    assert_eq!(mock.count(is_patch), 1, "nothing to re-assert");

    // The kubelet zeroes it (node re-registered), then it disappears: each is put back.
    mock.with(|s| s.node["status"]["capacity"]["vramguard.io/gpu-memory"] = json!("0"));
    eventually("a second patch", || mock.count(is_patch) == 2).await;
    mock.with(|s| {
        s.node["status"]["capacity"].as_object_mut().expect("capacity").remove("vramguard.io/gpu-memory");
    });
    eventually("a third patch", || mock.count(is_patch) == 3).await;
    assert_eq!(mock.with(|s| s.node["status"]["capacity"]["vramguard.io/gpu-memory"].clone()), json!("171798691840"));
    // The agent counts a patch once its answer is back: after the server has it.
    eventually("three patches counted", || capacity.state().patches() == 3).await;
    assert!(capacity.state().connected());

    // A GPU gone from the inventory: the new sum at once, not after a period.
    let slow = Mock::start(None).await;
    let (gpus, inventory) = tokio::sync::watch::channel(Some(std::sync::Arc::new(agent::inventory::from_flag(&[80 * GI, 80 * GI], 0))));
    let capacity = Capacity::start(client(&slow.url(), None, None), NODE, inventory, 1.5, Duration::from_secs(3600)).expect("start");
    eventually("the first patch", || slow.count(is_patch) == 1).await;
    assert_eq!(slow.with(|s| s.node["status"]["capacity"]["vramguard.io/gpu-memory"].clone()), json!((240 * GI).to_string()), "times the overcommit");
    gpus.send_replace(Some(std::sync::Arc::new(agent::inventory::from_flag(&[80 * GI], 0))));
    eventually("the new sum", || slow.count(is_patch) == 2).await;
    assert_eq!(slow.with(|s| s.node["status"]["capacity"]["vramguard.io/gpu-memory"].clone()), json!((120 * GI).to_string()));
    drop(capacity);
}

#[tokio::test]
async fn the_token_is_read_again_after_rotation() {
    let mock = Mock::start(None).await;
    let dir = temp_dir("token");
    let token = dir.join("token");
    // kube sends the file's bytes as they are: a token with a newline after it is refused
    // at the start, with the reason.
    std::fs::write(&token, "first-token\n").expect("token");
    let refused = KubeConfig::explicit(&mock.url(), Some(token.clone()), None).expect_err("a newline after the token");
    assert!(refused.to_string().contains("whitespace"), "{refused}");
    std::fs::write(&token, "first-token").expect("token");
    let cache = PodCache::start_with(client(&mock.url(), Some(token.clone()), None), NODE, tuning()).expect("start");
    eventually("the watch open", || mock.with(|s| !s.watches.is_empty())).await;
    let lookup = || cache.container_quota("ml", "nothing", "u", "c");
    assert!(matches!(lookup().await, Err(KubeError::PodNotFound { .. })));
    // As the kubelet rotates a projected token: a new file renamed over the old one. kube
    // reads the file again once its copy is 50 s old (it keeps it 60 s, and refreshes 10 s
    // before that); the kubelet rotates a token when 80% of its life (an hour at least) is
    // gone, so the old one is still good meanwhile.
    std::fs::write(dir.join("next"), "second-token").expect("token");
    std::fs::rename(dir.join("next"), &token).expect("rotate");
    let start = Instant::now();
    let second = Some("Bearer second-token".to_owned());
    while !mock.requests().iter().any(|r| is_pod_get(r) && r.authorization == second) {
        assert!(start.elapsed() < Duration::from_secs(75), "the rotated token was not read within 75 s");
        assert!(matches!(lookup().await, Err(KubeError::PodNotFound { .. })));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let auths: Vec<_> = mock.requests().into_iter().map(|r| r.authorization).collect();
    assert!(auths.iter().all(Option::is_some), "every request carries a token: {auths:?}");
    let first_new = auths.iter().position(|a| *a == second).expect("the new token");
    assert!(auths[..first_new].iter().all(|a| a.as_deref() == Some("Bearer first-token")), "{auths:?}");
    assert!(auths[first_new..].iter().all(|a| *a == second), "the old token is not sent again: {auths:?}");

    // kube does not retry a request the server refused with 401 (the token is only read
    // again on its schedule): the lookup fails as the API's answer says, the next one works.
    let late = fixture("pod-late.json");
    mock.with(|s| s.pods.insert(key(&late), late));
    mock.with(|s| s.unauthorized = 1);
    let refused = cache.container_quota("ml", "late-job-7xq2m", LATE_UID, "job").await;
    assert!(matches!(refused, Err(KubeError::Status { code: 401, .. })), "{refused:?}");
    let found = cache.container_quota("ml", "late-job-7xq2m", LATE_UID, "job").await;
    assert_eq!(found.expect("the next lookup"), Some(3 * GI / 2));
    std::fs::remove_dir_all(&dir).ok();
}

#[tokio::test]
async fn an_api_server_that_does_not_answer_is_an_error_within_the_deadline() {
    // Accepts connections and never answers.
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((tcp, _)) = listener.accept().await {
            held.push(tcp);
        }
    });
    let deadline = Duration::from_millis(300);
    let tuning = Tuning { lookup_deadline: deadline, ..tuning() };
    let cache = PodCache::start_with(client(&format!("http://{addr}"), None, None), NODE, tuning).expect("start");
    let start = Instant::now();
    let result = cache.container_quota("ml", "trainer", TRAINER_UID, "main").await;
    let took = start.elapsed();
    assert!(matches!(result, Err(KubeError::Timeout { .. })), "{result:?}");
    // The deadline is the point of the test (the runtime allows CreateContainer 2 s); the
    // slack only absorbs a loaded machine.
    assert!(took >= deadline && took < deadline + Duration::from_secs(1), "{took:?}");
    assert!(!cache.state().synced() && !cache.state().connected());
}

/// The pods the watch saw are written to the state file; a cache started with no API server
/// to reach reads them back and knows their quotas by UID, the static pod by its mirror.
#[tokio::test]
async fn the_pods_known_before_are_known_without_the_api_server() {
    let dir = temp_dir("remembered");
    let file = dir.join(REMEMBERED);
    let mock = Mock::start(None).await;
    mock.with(|s| s.listed = vec![fixture("pod-trainer.json"), fixture("pod-static-mirror.json")]);
    let cache = PodCache::start_with(client(&mock.url(), None, None), NODE, tuning()).expect("start");
    cache.remember_in(&file);
    eventually("the state written", || std::fs::read_to_string(&file).is_ok_and(|t| t.contains("gpu-probe-node-a"))).await;
    assert_eq!(cache.known("ml", "trainer", TRAINER_UID, "main"), Some((Ok(Some(8 * GI)), Known::Watch)));
    drop(cache);

    // Nothing listens there (a port bound and kept, never listening: refused, and no other
    // test's server can take it): every lookup fails, the state read back answers.
    let closed = tokio::net::TcpSocket::new_v4().expect("socket");
    closed.bind("127.0.0.1:0".parse().expect("address")).expect("bind");
    let url = format!("http://{}", closed.local_addr().expect("addr"));
    let cache = PodCache::start_with(client(&url, None, None), NODE, tuning()).expect("start");
    cache.remember_in(&file);
    assert_eq!(cache.known("ml", "trainer", TRAINER_UID, "main"), Some((Ok(Some(8 * GI)), Known::Disk)));
    assert_eq!(cache.known("ml", "trainer", TRAINER_UID, "sidecar"), Some((Ok(None), Known::Disk)));
    assert_eq!(cache.known("kube-system", "gpu-probe-node-a", STATIC_UID, "probe"), Some((Ok(Some(512 << 20)), Known::Disk)));
    assert_eq!(cache.known("ml", "trainer", "00000000-0000-4000-8000-000000000000", "main"), None, "another pod of that name");
    let lookup = cache.container_quota("ml", "late", LATE_UID, "main").await;
    assert!(matches!(lookup, Err(KubeError::Client { .. })), "{lookup:?}");
    // Another node's file is not this node's knowledge.
    let other = PodCache::start_with(client(&url, None, None), "node-b", tuning()).expect("start");
    other.remember_in(&file);
    assert_eq!(other.known("ml", "trainer", TRAINER_UID, "main"), None);
    drop(closed);
    std::fs::remove_dir_all(&dir).expect("cleanup");
}

#[tokio::test]
async fn tls_with_the_configured_ca() {
    let dir = temp_dir("tls");
    let (server_config, ca_pem) = self_signed("127.0.0.1");
    let ca = dir.join("ca.crt");
    std::fs::write(&ca, ca_pem).expect("ca");
    let mock = Mock::start(Some(server_config)).await;
    mock.with(|s| s.listed = vec![fixture("pod-trainer.json")]);
    let url = format!("https://{}", mock.addr);
    let cache = PodCache::start_with(client(&url, None, Some(ca)), NODE, tuning()).expect("start");
    eventually("the first list over TLS", || cache.state().synced()).await;
    assert_eq!(cache.container_quota("ml", "trainer", TRAINER_UID, "main").await.expect("main"), Some(8 * GI));

    // Negative control: a client trusting another CA refuses the server.
    let (_, other_pem) = self_signed("127.0.0.1");
    let other = dir.join("other.crt");
    std::fs::write(&other, other_pem).expect("ca");
    let stranger = PodCache::start_with(client(&url, None, Some(other)), NODE, tuning()).expect("start");
    let refused = stranger.container_quota("ml", "late", LATE_UID, "job").await;
    assert!(matches!(refused, Err(KubeError::Tls { .. })), "{refused:?}");
    std::fs::remove_dir_all(&dir).ok();
}

/// A CA and a server certificate for `ip` signed by it: the server's configuration and the
/// CA's PEM.
fn self_signed(ip: &str) -> (Arc<rustls::ServerConfig>, String) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair, SanType};
    let ca_key = KeyPair::generate().expect("key");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key).expect("ca");
    let ca_issuer = rcgen::Issuer::new(ca_params, ca_key);
    let server_key = KeyPair::generate().expect("key");
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
    params.subject_alt_names = vec![SanType::IpAddress(ip.parse().expect("ip"))];
    let server_cert = params.signed_by(&server_key, &ca_issuer).expect("server cert");
    let key = rustls::pki_types::PrivateKeyDer::try_from(server_key.serialize_der()).expect("key der");
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(vec![server_cert.der().clone()], key)
        .expect("server config");
    (Arc::new(config), ca_cert.pem())
}
