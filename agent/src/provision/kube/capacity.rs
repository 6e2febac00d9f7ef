//! The node's advertised `vramguard.io/gpu-memory`: the sum of its GPUs' memory times the
//! overcommit factor, in bytes, the GPUs being the agent's inventory ([`crate::inventory`]:
//! NVML's, `--gpu-memory`'s only where NVML is absent); nothing is advertised before the
//! inventory has a GPU, and a change of the inventory is advertised at once. Every period the node is read (`GET`) and, when its
//! `status.capacity` lacks the resource or holds another value (the kubelet zeroes extended
//! resources when it believes the node was recreated), patched through the status
//! subresource (kube's `patch_status`) with the JSON patch the API documents for extended
//! resources; the kubelet copies capacity into allocatable.
use std::{
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use k8s_openapi::api::core::v1::Node;
use kube::{
    api::{Patch, PatchParams},
    Api, Client,
};
use tokio::task::JoinHandle;
use tracing::{info, warn};

use super::{parse_quantity, valid_name, Backoff, KubeError, RESOURCE};

/// How long one read or patch of the node may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The field manager the status patch names.
const FIELD_MANAGER: &str = "vramguard";

/// The content type of a JSON patch (RFC 6902).
pub const JSON_PATCH: &str = "application/json-patch+json";

/// The advertised capacity's state, for `/readyz` and metrics.
#[derive(Debug, Default)]
pub struct CapacityState {
    asserted: AtomicBool,
    connected: AtomicBool,
    patches: AtomicU64,
    errors: AtomicU64,
}

impl CapacityState {
    /// Whether the node's status held the agent's value at the last check (or was patched to).
    pub fn asserted(&self) -> bool {
        self.asserted.load(Ordering::Relaxed)
    }
    /// Whether the last check reached the API server.
    pub fn connected(&self) -> bool {
        self.connected.load(Ordering::Relaxed)
    }
    /// Patches sent and accepted.
    pub fn patches(&self) -> u64 {
        self.patches.load(Ordering::Relaxed)
    }
    /// Checks that failed.
    pub fn errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }
}

/// The task that keeps the node's capacity; stops when dropped.
pub struct Capacity {
    state: Arc<CapacityState>,
    task: JoinHandle<()>,
    /// The task's end, until the agent's supervisor takes it ([`Capacity::take_alive`]).
    alive: Option<crate::task::Alive>,
}

impl Drop for Capacity {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Capacity {
    /// Starts advertising `sum(the GPUs' memory) * overcommit` bytes on `node`, the GPUs
    /// being `gpus`' (the agent's inventory), checked every `every` and whenever `gpus`
    /// changes, on the current tokio runtime.
    pub fn start(client: Client, node: &str, gpus: crate::inventory::Shared, overcommit: f64, every: Duration) -> Result<Capacity, KubeError> {
        valid_name("node", node)?;
        capacity_bytes(&[1 << 30], overcommit)?;
        if every.is_zero() {
            return Err(KubeError::Config("the capacity's period must be more than zero".into()));
        }
        let state = Arc::new(CapacityState::default());
        let (sentinel, alive) = crate::task::sentinel();
        let advertise = run(client, node.to_owned(), gpus, overcommit, every, state.clone());
        let task = tokio::spawn(async move {
            let _sentinel = sentinel;
            advertise.await;
        });
        Ok(Capacity { state, task, alive: Some(alive) })
    }

    /// The task's end, for the agent's supervisor (once).
    pub fn take_alive(&mut self) -> Option<crate::task::Alive> {
        self.alive.take()
    }

    pub fn state(&self) -> &CapacityState {
        &self.state
    }
}

/// `sum(bytes_per_gpu) * overcommit`, rounded down; refused when there is no GPU, the
/// factor is not a positive finite number, or the result does not fit.
pub fn capacity_bytes(bytes_per_gpu: &[u64], overcommit: f64) -> Result<u64, KubeError> {
    if bytes_per_gpu.is_empty() {
        return Err(KubeError::Config("no GPU: the node's inventory is empty".into()));
    }
    if !(overcommit.is_finite() && overcommit > 0.0) {
        return Err(KubeError::Config(format!("the overcommit factor must be a positive number, not {overcommit}")));
    }
    let total = bytes_per_gpu
        .iter()
        .try_fold(0u64, |acc, &b| acc.checked_add(b))
        .ok_or_else(|| KubeError::Config("the GPUs' memory adds up past 2^64 bytes".into()))?;
    if overcommit == 1.0 {
        return Ok(total);
    }
    let scaled = total as f64 * overcommit;
    // A quantity the API stores must fit in an int64.
    if scaled >= i64::MAX as f64 {
        return Err(KubeError::Config(format!("{total} bytes times {overcommit} is too large")));
    }
    Ok(scaled as u64)
}

/// The JSON patch setting `status.capacity["vramguard.io/gpu-memory"]` to `bytes`.
pub fn patch_body(bytes: u64) -> Vec<u8> {
    let path = format!("/status/capacity/{}", RESOURCE.replace('~', "~0").replace('/', "~1"));
    serde_json::json!([{ "op": "add", "path": path, "value": bytes.to_string() }]).to_string().into_bytes()
}

async fn run(client: Client, node: String, mut gpus: crate::inventory::Shared, overcommit: f64, every: Duration, state: Arc<CapacityState>) {
    let mut backoff = Backoff::new(Duration::from_millis(500).min(every), every);
    let api: Api<Node> = Api::all(client);
    loop {
        let memory: Vec<u64> = gpus.borrow_and_update().as_ref().map(|inventory| inventory.gpus.iter().map(|gpu| gpu.memory).collect()).unwrap_or_default();
        let wait = if memory.is_empty() {
            // No inventory yet (NVML not read, or absent without --gpu-memory): nothing to say.
            state.asserted.store(false, Ordering::Relaxed);
            None
        } else {
            match capacity_bytes(&memory, overcommit) {
                Err(error) => {
                    warn!("kube: the node's {RESOURCE} cannot be advertised: {error}");
                    state.errors.fetch_add(1, Ordering::Relaxed);
                    None
                }
                Ok(bytes) => match check(&api, &node, bytes, &state).await {
                    Ok(()) => {
                        state.connected.store(true, Ordering::Relaxed);
                        kube::runtime::utils::Backoff::reset(&mut backoff);
                        Some(every)
                    }
                    Err(error) => {
                        warn!("kube: advertising {RESOURCE}={bytes} on node {node}: {error}");
                        state.connected.store(false, Ordering::Relaxed);
                        state.errors.fetch_add(1, Ordering::Relaxed);
                        Some(backoff.next_wait())
                    }
                },
            }
        };
        // The period, or at once when the GPUs change (never, once the inventory is gone at
        // the agent's stop: the task is aborted then).
        let changed = async {
            if gpus.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        };
        match wait {
            Some(wait) => {
                let _ = tokio::time::timeout(wait, changed).await;
            }
            None => changed.await,
        }
    }
}

/// Reads the node; patches its status if the resource is missing or different.
async fn check(api: &Api<Node>, node: &str, bytes: u64, state: &CapacityState) -> Result<(), KubeError> {
    let what = format!("reading node {node}");
    let current = tokio::time::timeout(REQUEST_TIMEOUT, api.get(node))
        .await
        .map_err(|_| KubeError::Timeout { what: what.clone(), after: REQUEST_TIMEOUT })?
        .map_err(|e| KubeError::from_kube(what, e))?;
    let seen = current.status.as_ref().and_then(|s| s.capacity.as_ref()).and_then(|c| c.get(RESOURCE)).map(|q| q.0.clone());
    if seen.as_deref().and_then(parse_quantity) == Some(bytes) {
        state.asserted.store(true, Ordering::Relaxed);
        return Ok(());
    }
    state.asserted.store(false, Ordering::Relaxed);
    let what = format!("patching node {node}'s status");
    let patch: json_patch::Patch = serde_json::from_slice(&patch_body(bytes))
        .map_err(|e| KubeError::Config(format!("the capacity's JSON patch: {e}")))?;
    let params = PatchParams { field_manager: Some(FIELD_MANAGER.into()), ..PatchParams::default() };
    tokio::time::timeout(REQUEST_TIMEOUT, api.patch_status(node, &params, &Patch::<()>::Json(patch)))
        .await
        .map_err(|_| KubeError::Timeout { what: what.clone(), after: REQUEST_TIMEOUT })?
        .map_err(|e| KubeError::from_kube(what, e))?;
    state.patches.fetch_add(1, Ordering::Relaxed);
    state.asserted.store(true, Ordering::Relaxed);
    match seen {
        None => info!("kube: node {node} advertises {RESOURCE}={bytes}"),
        Some(old) => info!("kube: node {node} advertised {RESOURCE}={old}: set to {bytes} again"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_is_the_sum_times_the_factor() {
        assert_eq!(capacity_bytes(&[80 << 30, 80 << 30], 1.0).ok(), Some(160 << 30));
        assert_eq!(capacity_bytes(&[80 << 30], 1.5).ok(), Some(120 << 30));
        assert_eq!(capacity_bytes(&[3], 0.5).ok(), Some(1), "rounded down");
        assert!(capacity_bytes(&[], 1.0).is_err());
        for factor in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(capacity_bytes(&[1 << 30], factor).is_err(), "{factor}");
        }
        assert!(capacity_bytes(&[u64::MAX, 1], 1.0).is_err());
        assert!(capacity_bytes(&[1 << 62], 4.0).is_err());
    }

    #[test]
    fn the_patch_escapes_the_resource_name() {
        let body = String::from_utf8(patch_body(1 << 30)).expect("utf-8");
        assert_eq!(body, r#"[{"op":"add","path":"/status/capacity/vramguard.io~1gpu-memory","value":"1073741824"}]"#);
    }
}
