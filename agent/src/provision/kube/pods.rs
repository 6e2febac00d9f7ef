//! The pods on this node, as the API server has them, kept by kube's watcher
//! (`fieldSelector=spec.nodeName=<node>`: paged list, watch with bookmarks, relist on `410
//! Gone`, backoff after errors); only each pod's quotas are kept, not the pods.
//! [`PodCache::container_quota`] answers from it, or with one direct `GET` of the pod,
//! bounded by a deadline, when the pod is not there yet.
use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::{
    runtime::{watcher, WatchStreamExt},
    Api, Client,
};
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use super::{
    objects::{Limit, PodQuotas},
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
    /// How long the server keeps one watch open (`timeoutSeconds`, at most 290 s); kube's
    /// watcher gives up on a watch that has said nothing for this long plus a margin.
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
            watch_timeout: Duration::from_secs(290),
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
    fn failed(&self, what: &str, error: &dyn std::fmt::Display) {
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
    /// The watch task's end, until the agent's supervisor takes it ([`PodCache::take_alive`]).
    alive: Mutex<Option<crate::task::Alive>>,
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
        let (sentinel, alive) = crate::task::sentinel();
        let watch = run(client.clone(), node.to_owned(), shared.clone(), tuning);
        let task = tokio::spawn(async move {
            let _sentinel = sentinel;
            watch.await;
        });
        Ok(PodCache { inner: Arc::new(Inner { client, shared, tuning, task, alive: Mutex::new(Some(alive)) }) })
    }

    /// The watch task's end, for the agent's supervisor (once).
    pub fn take_alive(&self) -> Option<crate::task::Alive> {
        self.inner.alive.lock().ok()?.take()
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
        let what = format!("looking up pod {namespace}/{pod}");
        let api: Api<Pod> = Api::namespaced(self.inner.client.clone(), namespace);
        let found = match tokio::time::timeout(deadline, api.get_opt(pod)).await {
            Ok(Ok(Some(found))) => found,
            Ok(Ok(None)) => {
                return Err(KubeError::PodNotFound { namespace: namespace.into(), pod: pod.into(), uid: uid.into() })
            }
            Ok(Err(error)) => {
                let error = KubeError::from_kube(what.clone(), error);
                self.inner.shared.failed(&what, &error);
                return Err(error);
            }
            Err(_) => {
                let error = KubeError::Timeout { what: what.clone(), after: deadline };
                self.inner.shared.failed(&what, &error);
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

/// Keeps the cache from kube's watcher: a paged, consistent list of the node's pods
/// (`Init`, `InitApply`.., `InitDone`: the cache is replaced at the end), then a watch from
/// the list's version with bookmarks, resumed from the last version seen when the server ends
/// it, relisted after `410 Gone`; after an error, the watcher waits by the backoff.
async fn run(client: Client, node: String, shared: Arc<Shared>, tuning: Tuning) {
    let config = watcher::Config::default()
        .fields(&format!("spec.nodeName={node}"))
        .page_size(tuning.page_size)
        .timeout(u32::try_from(tuning.watch_timeout.as_secs()).unwrap_or(u32::MAX).clamp(1, MAX_WATCH_TIMEOUT_S))
        .list_semantic(watcher::ListSemantic::MostRecent);
    let api: Api<Pod> = Api::all(client);
    // kube's watcher relists after a `410 Gone` that comes as a watch's ERROR event, but
    // when the watch request itself is answered 410 it retries the same version for ever:
    // then the watcher is started again, from a list.
    loop {
        let events = watcher(api.clone(), config.clone()).backoff(Backoff::new(tuning.backoff_min, tuning.backoff_max));
        let mut events = std::pin::pin!(events);
        let mut listing: Option<HashMap<Key, PodQuotas>> = None;
        while let Some(event) = events.next().await {
            match event {
                Ok(event) => apply(&shared, &node, &mut listing, event),
                Err(watcher::Error::WatchStartFailed(kube::Error::Api(status))) if status.code == 410 => {
                    info!("kube: the pods' watch is too old (410 Gone at its start): listing again");
                    shared.failed("watching pods", &status);
                    break;
                }
                Err(error) => {
                    if matches!(&error, watcher::Error::WatchError(status) if status.code == 410) {
                        info!("kube: the pods' watch is too old (410 Gone): listing again");
                    }
                    let what = if shared.state.synced() { "watching pods" } else { "listing pods" };
                    shared.failed(what, &error);
                }
            }
        }
        tokio::time::sleep(tuning.backoff_min).await;
    }
}

/// One of the watcher's events into the cache: a list's pods are gathered in `listing` and
/// replace the cache at its end.
fn apply(shared: &Shared, node: &str, listing: &mut Option<HashMap<Key, PodQuotas>>, event: watcher::Event<Pod>) {
    shared.state.connected.store(true, Ordering::Relaxed);
    match event {
        watcher::Event::Init => *listing = Some(HashMap::new()),
        watcher::Event::InitApply(pod) => {
            listing.get_or_insert_with(HashMap::new).insert(key(&pod), PodQuotas::from_pod(&pod));
        }
        watcher::Event::InitDone => {
            let pods = listing.take().unwrap_or_default();
            let count = pods.len();
            *shared.pods() = pods;
            shared.state.pods.store(count as u64, Ordering::Relaxed);
            shared.state.lists.fetch_add(1, Ordering::Relaxed);
            if !shared.state.synced.swap(true, Ordering::Relaxed) {
                info!("kube: {count} pods on node {node} listed; watching");
            } else {
                debug!("kube: {count} pods on node {node} listed again");
            }
        }
        watcher::Event::Apply(pod) => {
            let mut pods = shared.pods();
            pods.insert(key(&pod), PodQuotas::from_pod(&pod));
            shared.state.pods.store(pods.len() as u64, Ordering::Relaxed);
        }
        watcher::Event::Delete(pod) => {
            let mut pods = shared.pods();
            let key = key(&pod);
            if pods.get(&key).is_some_and(|p| Some(&p.uid) == pod.metadata.uid.as_ref()) {
                pods.remove(&key);
            }
            shared.state.pods.store(pods.len() as u64, Ordering::Relaxed);
        }
    }
}

/// The longest watch kube lets the server hold (its idle timeout adds a margin to it).
const MAX_WATCH_TIMEOUT_S: u32 = 290;

fn key(pod: &Pod) -> Key {
    (pod.metadata.namespace.clone().unwrap_or_default(), pod.metadata.name.clone().unwrap_or_default())
}
