//! The pods on this node, as the API server has them: listed once
//! (`fieldSelector=spec.nodeName=<node>`, paged), then watched from the list's
//! resourceVersion, the watch resumed from the last version seen when it ends, relisted on
//! `410 Gone`, with backoff after errors. [`PodCache::container_quota`] answers from it, or
//! with one direct `GET` of the pod, bounded by a deadline, when the pod is not there yet.
use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use tokio::{task::JoinHandle, time::Instant};
use tracing::{debug, info, warn};

use super::{
    client::{Client, REQUEST_TIMEOUT},
    objects::{Limit, Pod, PodList, PodQuotas, Status, WatchEvent},
    valid_name, Backoff, KubeError, RESOURCE,
};

/// How the cache behaves; [`Tuning::default`] is production's.
#[derive(Clone, Copy, Debug)]
pub struct Tuning {
    /// The most time [`PodCache::container_quota`] takes when it must ask the API server.
    pub lookup_deadline: Duration,
    /// The first wait after an error; doubled after each error that follows, up to `backoff_max`.
    pub backoff_min: Duration,
    pub backoff_max: Duration,
    /// How long the server keeps one watch open (`timeoutSeconds`); the client gives up on a
    /// watch that has said nothing for this long plus a minute.
    pub watch_timeout: Duration,
    /// Pods asked for per page of the list.
    pub page_size: u32,
}

impl Default for Tuning {
    fn default() -> Tuning {
        Tuning {
            lookup_deadline: Duration::from_secs(1),
            backoff_min: Duration::from_millis(500),
            backoff_max: Duration::from_secs(30),
            watch_timeout: Duration::from_secs(300),
            page_size: 500,
        }
    }
}

/// The state of the cache's connection to the API server, for `/readyz` and metrics.
#[derive(Debug, Default)]
pub struct CacheState {
    connected: AtomicBool,
    synced: AtomicBool,
    lists: AtomicU64,
    errors: AtomicU64,
    pods: AtomicU64,
}

impl CacheState {
    /// Whether the last exchange with the API server succeeded (a list, or a watch open).
    pub fn connected(&self) -> bool {
        self.connected.load(Ordering::Relaxed)
    }
    /// Whether a list has completed since start: from then on the cache has every pod the
    /// node had at that list (limits are immutable, so what it holds stays true).
    pub fn synced(&self) -> bool {
        self.synced.load(Ordering::Relaxed)
    }
    /// Lists completed (the first one and every relist).
    pub fn lists(&self) -> u64 {
        self.lists.load(Ordering::Relaxed)
    }
    /// Failed exchanges with the API server (lists, watches, direct lookups).
    pub fn errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }
    /// Pods in the cache.
    pub fn pods(&self) -> u64 {
        self.pods.load(Ordering::Relaxed)
    }
}

type Key = (String, String);

struct Shared {
    pods: Mutex<HashMap<Key, PodQuotas>>,
    state: CacheState,
}

impl Shared {
    fn pods(&self) -> std::sync::MutexGuard<'_, HashMap<Key, PodQuotas>> {
        self.pods.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
    fn failed(&self, what: &str, error: &KubeError) {
        self.state.connected.store(false, Ordering::Relaxed);
        self.state.errors.fetch_add(1, Ordering::Relaxed);
        warn!("kube: {what}: {error}");
    }
}

/// The cache of the pods on one node; its watch task runs until the last clone is dropped.
#[derive(Clone)]
pub struct PodCache {
    inner: Arc<Inner>,
}

struct Inner {
    client: Client,
    shared: Arc<Shared>,
    tuning: Tuning,
    task: JoinHandle<()>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl PodCache {
    /// Starts listing and watching the pods of `node` on the current tokio runtime.
    pub fn start(client: Client, node: &str) -> Result<PodCache, KubeError> {
        PodCache::start_with(client, node, Tuning::default())
    }

    /// [`PodCache::start`] with other timings (tests).
    pub fn start_with(client: Client, node: &str, tuning: Tuning) -> Result<PodCache, KubeError> {
        valid_name("node", node)?;
        let shared = Arc::new(Shared { pods: Mutex::new(HashMap::new()), state: CacheState::default() });
        let task = tokio::spawn(run(client.clone(), node.to_owned(), shared.clone(), tuning));
        Ok(PodCache { inner: Arc::new(Inner { client, shared, tuning, task }) })
    }

    /// The connection's state.
    pub fn state(&self) -> &CacheState {
        &self.inner.shared.state
    }

    /// The `vramguard.io/gpu-memory` limit of container `container` of the pod
    /// `namespace/pod` whose UID is `uid` (the runtime's), in bytes; `None` when it has none.
    /// Init and ephemeral containers count (the latter never have one). A pod of that name
    /// with another UID is another pod. Answered from the cache, or else by one `GET` of the
    /// pod, the whole within the lookup deadline (1 s).
    pub async fn container_quota(
        &self,
        namespace: &str,
        pod: &str,
        uid: &str,
        container: &str,
    ) -> Result<Option<u64>, KubeError> {
        valid_name("namespace", namespace)?;
        valid_name("pod", pod)?;
        let key = (namespace.to_owned(), pod.to_owned());
        let cached = self.inner.shared.pods().get(&key).filter(|p| p.is(uid)).and_then(|p| p.containers.get(container).cloned());
        if let Some(limit) = cached {
            return answer(limit, namespace, pod, container);
        }
        let deadline = self.inner.tuning.lookup_deadline;
        let path = format!("/api/v1/namespaces/{namespace}/pods/{pod}");
        let found = match tokio::time::timeout(deadline, self.inner.client.get::<Pod>(&path)).await {
            Ok(Ok(found)) => found,
            Ok(Err(KubeError::Status { code: 404, .. })) => {
                return Err(KubeError::PodNotFound { namespace: namespace.into(), pod: pod.into(), uid: uid.into() })
            }
            Ok(Err(error)) => {
                self.inner.shared.failed(&format!("looking up pod {namespace}/{pod}"), &error);
                return Err(error);
            }
            Err(_) => {
                let error = KubeError::Timeout { what: format!("GET {path}"), after: deadline };
                self.inner.shared.failed(&format!("looking up pod {namespace}/{pod}"), &error);
                return Err(error);
            }
        };
        let found = PodQuotas::from_pod(&found);
        if !found.is(uid) {
            return Err(KubeError::PodNotFound { namespace: namespace.into(), pod: pod.into(), uid: uid.into() });
        }
        match found.containers.get(container) {
            Some(limit) => answer(limit.clone(), namespace, pod, container),
            None => Err(KubeError::NoContainer {
                namespace: namespace.into(),
                pod: pod.into(),
                container: container.into(),
            }),
        }
    }
}

fn answer(limit: Limit, namespace: &str, pod: &str, container: &str) -> Result<Option<u64>, KubeError> {
    limit.map_err(|value| KubeError::BadQuantity {
        what: format!("container {container} of pod {namespace}/{pod}: limit {RESOURCE}"),
        value,
    })
}

async fn run(client: Client, node: String, shared: Arc<Shared>, tuning: Tuning) {
    let mut backoff = Backoff::new(tuning.backoff_min, tuning.backoff_max);
    let mut version: Option<String> = None;
    loop {
        // A watch that ends without error (the server's timeout) is resumed from the last
        // version seen.
        let result = match version.clone() {
            None => list(&client, &node, &shared, tuning).await.map(|v| version = Some(v)),
            Some(from) => watch(&client, &node, &shared, tuning, from, &mut version, &mut backoff).await,
        };
        match result {
            Ok(()) => {}
            // As the watch's answer, or as an ERROR event in it.
            Err(KubeError::Status { code: 410, .. }) => {
                info!("kube: the pods' list or watch is too old (410 Gone): listing again");
                version = None;
            }
            Err(error) => {
                shared.failed(if version.is_some() { "watching pods" } else { "listing pods" }, &error);
                tokio::time::sleep(backoff.next()).await;
            }
        }
    }
}

/// Lists the node's pods (every page) into the cache; returns the list's resourceVersion.
async fn list(client: &Client, node: &str, shared: &Shared, tuning: Tuning) -> Result<String, KubeError> {
    let mut pods = HashMap::new();
    let mut continue_token = String::new();
    let version = loop {
        let mut path = format!("/api/v1/pods?fieldSelector=spec.nodeName%3D{node}&limit={}", tuning.page_size);
        if !continue_token.is_empty() {
            path.push_str("&continue=");
            path.push_str(&encode_query_value(&continue_token));
        }
        let page: PodList = tokio::time::timeout(REQUEST_TIMEOUT, client.get(&path))
            .await
            .map_err(|_| KubeError::Timeout { what: format!("GET {path}"), after: REQUEST_TIMEOUT })??;
        for pod in &page.items {
            pods.insert((pod.metadata.namespace.clone(), pod.metadata.name.clone()), PodQuotas::from_pod(pod));
        }
        if page.metadata.continue_token.is_empty() {
            break page.metadata.resource_version;
        }
        continue_token = page.metadata.continue_token;
    };
    if version.is_empty() {
        return Err(KubeError::Decode { what: "the pods' list".into(), reason: "no resourceVersion".into() });
    }
    let count = pods.len();
    *shared.pods() = pods;
    shared.state.pods.store(count as u64, Ordering::Relaxed);
    shared.state.lists.fetch_add(1, Ordering::Relaxed);
    shared.state.connected.store(true, Ordering::Relaxed);
    if !shared.state.synced.swap(true, Ordering::Relaxed) {
        info!("kube: {count} pods on node {node} listed (version {version}); watching");
    } else {
        debug!("kube: {count} pods on node {node} listed again (version {version})");
    }
    Ok(version)
}

/// Watches from `from`, applying every event to the cache and moving `version` along.
async fn watch(
    client: &Client,
    node: &str,
    shared: &Shared,
    tuning: Tuning,
    from: String,
    version: &mut Option<String>,
    backoff: &mut Backoff,
) -> Result<(), KubeError> {
    let path = format!(
        "/api/v1/pods?fieldSelector=spec.nodeName%3D{node}&watch=1&allowWatchBookmarks=true&timeoutSeconds={}&resourceVersion={}",
        tuning.watch_timeout.as_secs().max(1),
        encode_query_value(&from),
    );
    let idle = tuning.watch_timeout + Duration::from_secs(60);
    let mut lines = tokio::time::timeout(REQUEST_TIMEOUT, client.watch(&path))
        .await
        .map_err(|_| KubeError::Timeout { what: format!("GET {path}"), after: REQUEST_TIMEOUT })??;
    shared.state.connected.store(true, Ordering::Relaxed);
    let started = Instant::now();
    loop {
        let line = match tokio::time::timeout(idle, lines.next()).await {
            Ok(line) => line?,
            Err(_) => return Err(KubeError::Timeout { what: "the pods' watch".into(), after: idle }),
        };
        let Some(line) = line else {
            // A watch that the server ends at once, again and again, is an error in disguise.
            if started.elapsed() >= tuning.backoff_min {
                backoff.reset();
            } else {
                tokio::time::sleep(backoff.next()).await;
            }
            return Ok(());
        };
        let event: WatchEvent = serde_json::from_slice(&line)
            .map_err(|e| KubeError::Decode { what: "a pods' watch event".into(), reason: e.to_string() })?;
        let decode = |e: serde_json::Error| KubeError::Decode { what: format!("a pod in a {} event", event.kind), reason: e.to_string() };
        match event.kind.as_str() {
            "ADDED" | "MODIFIED" | "DELETED" => {
                let pod: Pod = serde_json::from_value(event.object).map_err(decode)?;
                let key = (pod.metadata.namespace.clone(), pod.metadata.name.clone());
                let mut pods = shared.pods();
                if event.kind == "DELETED" {
                    if pods.get(&key).is_some_and(|p| p.uid == pod.metadata.uid) {
                        pods.remove(&key);
                    }
                } else {
                    pods.insert(key, PodQuotas::from_pod(&pod));
                }
                shared.state.pods.store(pods.len() as u64, Ordering::Relaxed);
                drop(pods);
                set_version(version, pod.metadata.resource_version);
            }
            "BOOKMARK" => {
                let pod: Pod = serde_json::from_value(event.object).map_err(decode)?;
                set_version(version, pod.metadata.resource_version);
            }
            "ERROR" => {
                let status: Status = serde_json::from_value(event.object).unwrap_or_default();
                return Err(KubeError::Status { code: status.code, what: "the pods' watch".into(), message: status.message });
            }
            other => debug!("kube: pods' watch: ignoring an event of type {other:?}"),
        }
        backoff.reset();
    }
}

fn set_version(version: &mut Option<String>, new: String) {
    if !new.is_empty() {
        *version = Some(new);
    }
}

/// Percent-encodes a query value (resourceVersions are digits; continue tokens are base64).
fn encode_query_value(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn query_values_are_encoded() {
        assert_eq!(super::encode_query_value("123"), "123");
        assert_eq!(super::encode_query_value("eyJ2Ijo+/="), "eyJ2Ijo%2B%2F%3D");
    }
}
