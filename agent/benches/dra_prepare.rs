//! The DRA kubelet plugin's prepare latency with 100 claims prepared on the node (issue 25,
//! Numbers: "prepare latency p50/p99 with 100 claims on the node"): the plugin's servers
//! ([`agent::dra::plugin::start`]) on Unix sockets in a directory on the target's disk, called
//! through the generated client as the kubelet calls them, one claim a call. Each call is a
//! claim not prepared yet: its checks, its CDI spec, the checkpoint of 101 claims written and
//! synced, the answer; then it is unprepared again, so that every call finds 100 claims. The
//! API server is an in-memory one answering at once: a real one's round trip comes on top.
//!
//! Run with `cargo bench -p agent --bench dra_prepare`; prints `dra_prepare: ... p50=<us>
//! p99=<us>`. `DRA_PREPARE_DIR` puts the files elsewhere (`/dev/shm`: without the disk's
//! fsync, the driver's own work).
use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use agent::{
    dra::{
        checkpoint::Checkpoint,
        health::Health,
        plugin::{start, Metrics, Sockets},
        prepare::{Claims, Preparer},
        proto::v1::{dra_plugin_client::DraPluginClient, Claim, NodePrepareResourcesRequest, NodeUnprepareResourcesRequest},
        DRIVER,
    },
    driver::DriverView,
};
use k8s_openapi::api::resource::v1::ResourceClaim;
use tokio::sync::watch;

/// Claims prepared on the node while a prepare is measured.
const PREPARED: usize = 100;
/// Prepares measured.
const ROUNDS: usize = 500;
const NODE: &str = "bench-node";

struct InMemory(Mutex<BTreeMap<String, ResourceClaim>>);

impl Claims for InMemory {
    async fn get(&self, _namespace: &str, name: &str) -> Result<Option<ResourceClaim>, String> {
        Ok(self.0.lock().map_err(|e| e.to_string())?.get(name).cloned())
    }
}

fn claim(index: usize) -> (String, ResourceClaim) {
    let (name, uid) = (format!("claim-{index}"), format!("00000000-0000-4000-8000-{index:012}"));
    let value = serde_json::json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "bench", "uid": uid},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
        "status": {"allocation": {"devices": {"results": [{
            "request": "gpu", "driver": DRIVER, "pool": NODE, "device": format!("gpu-{}", index % 4),
            "shareID": format!("10000000-0000-4000-8000-{index:012}"), "consumedCapacity": {"memory": "256Mi"}
        }]}}}
    });
    (name, serde_json::from_value(value).expect("a claim"))
}

fn asked(index: usize) -> Claim {
    Claim { namespace: "bench".into(), uid: format!("00000000-0000-4000-8000-{index:012}"), name: format!("claim-{index}") }
}

fn main() {
    let base = std::env::var_os("DRA_PREPARE_DIR").map_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")), PathBuf::from);
    let dir = base.join(format!("dra-prepare-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("bench dir");
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let claims = InMemory(Mutex::new((0..PREPARED + ROUNDS).map(claim).collect()));
    let checkpoint = Checkpoint::open(&dir.join("state")).expect("checkpoint");
    let gpus = agent::inventory::fixed(Some(agent::inventory::from_flag(&[80 << 30; 4], 0)));
    let preparer = Preparer::new(claims, NODE.into(), gpus.clone(), dir.join("cdi"), dir.join("state"), checkpoint);
    let (_driver_tx, driver) = watch::channel(Arc::new(DriverView::default()));
    let health = Health { pool: NODE.into(), gpus, known: Default::default(), driver };
    // No claim goes from the API server while it runs: the stale sweep never drops one.
    let stale = agent::dra::plugin::Stale { after: std::time::Duration::from_secs(3600), every: std::time::Duration::from_secs(3600) };
    let sockets = Sockets { registry_dir: dir.join("registry"), plugins_dir: dir.join("plugins") };
    let (_stop_tx, stop) = watch::channel(false);
    let latencies = runtime.block_on(async {
        let serving = start(sockets.clone(), preparer, health, Metrics::new().expect("metrics"), stale, stop).expect("start");
        tokio::spawn(serving);
        let channel = tonic::transport::Endpoint::try_from(format!("unix://{}", sockets.dra().display()))
            .expect("endpoint")
            .connect()
            .await
            .expect("connect");
        let mut client = DraPluginClient::new(channel);
        for index in 0..PREPARED {
            let answer = client.node_prepare_resources(NodePrepareResourcesRequest { claims: vec![asked(index)] }).await.expect("prepare");
            assert!(answer.into_inner().claims.values().all(|c| c.error.is_empty()), "the node's claims prepare");
        }
        let mut latencies = Vec::with_capacity(ROUNDS);
        for index in PREPARED..PREPARED + ROUNDS {
            let started = Instant::now();
            let answer = client.node_prepare_resources(NodePrepareResourcesRequest { claims: vec![asked(index)] }).await.expect("prepare");
            latencies.push(started.elapsed());
            assert!(answer.into_inner().claims.values().all(|c| c.error.is_empty() && c.devices.len() == 1), "prepared");
            client.node_unprepare_resources(NodeUnprepareResourcesRequest { claims: vec![asked(index)] }).await.expect("unprepare");
        }
        latencies
    });
    let mut sorted = latencies;
    sorted.sort();
    let at = |q: f64| sorted[((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1];
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!(
        "dra_prepare: {ROUNDS} prepares with {PREPARED} claims prepared on the node: p50={:.0} p99={:.0} max={:.0} (us)",
        us(at(0.50)),
        us(at(0.99)),
        us(at(1.0))
    );
    drop(runtime);
    let _ = std::fs::remove_dir_all(&dir);
}
