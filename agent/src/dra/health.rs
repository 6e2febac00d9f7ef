//! The devices' health for the kubelet (`v1alpha1.DRAResourceHealth`, served on the DRA
//! socket beside `v1.DRAPlugin`): `NodeWatchResources` streams the health of every GPU of the
//! node's pool, from the driver task's view of NVML ([`crate::driver`]):
//!
//! | NVML ([`State`]) | health |
//! |---|---|
//! | `ok` (the last read answered) | `HEALTHY` |
//! | `failing` (init or a read returned an error), `hung` (a read past its budget) | `UNHEALTHY`, the reason as the message |
//! | `starting`, `absent` (no NVML library) | `UNKNOWN`: nothing says how the GPUs are |
//!
//! A message goes at once, then at every change of that health, and again every
//! [`RESEND`] (well within the [`TIMEOUT`] it gives the kubelet), so that the kubelet's view is
//! never older than the timeout it was told. A watch ends when the kubelet goes.
use std::{pin::Pin, sync::Arc, time::Duration};

use tokio::sync::{mpsc, watch};
use tokio_stream::{wrappers::ReceiverStream, Stream};
use tonic::{Request, Response, Status};

use super::{
    device_name,
    proto::health::{
        dra_resource_health_server::DraResourceHealth, DeviceHealth, DeviceIdentifier, HealthStatus, NodeWatchResourcesRequest,
        NodeWatchResourcesResponse,
    },
};
use crate::{
    driver::{DriverView, State},
    inventory,
};

/// The health service as the registration names it.
pub const SERVICE: &str = "v1alpha1.DRAResourceHealth";

/// How often the health is sent again without a change.
pub const RESEND: Duration = Duration::from_secs(20);
/// How long the kubelet may go without a message before it takes the health as unknown.
pub const TIMEOUT: Duration = Duration::from_secs(60);

/// The health service: the node's pool, its GPUs (the [`inventory`] the slices publish), and
/// the driver task's view.
pub struct Health {
    pub pool: String,
    pub gpus: inventory::Shared,
    /// Every GPU the health has listed, and those it lists before NVML ever answered
    /// (`--gpu-memory`'s indices and the GPUs of the claims prepared when the agent started):
    /// one the inventory no longer has (NVML stopped listing it) is reported unhealthy, not
    /// dropped from the list, so that the pods of its claims see it.
    pub known: std::sync::Mutex<std::collections::BTreeSet<u32>>,
    pub driver: watch::Receiver<Arc<DriverView>>,
}

/// The GPUs' health as the driver's state says, with its message.
pub fn health_of(view: &DriverView) -> (HealthStatus, String) {
    let reason = view.status.reason.clone().unwrap_or_default();
    match view.status.state {
        State::Ok => (HealthStatus::Healthy, String::new()),
        State::Failing | State::Hung => (HealthStatus::Unhealthy, format!("NVML is {}: {reason}", view.status.state.name())),
        State::Starting | State::Absent => (HealthStatus::Unknown, format!("NVML is {}: {reason}", view.status.state.name())),
    }
}

/// Each GPU's health and its message, by index.
type Healths = Vec<(u32, HealthStatus, String)>;

impl Health {
    /// The health of every GPU the node has or had: the driver's state for those the
    /// inventory lists (all known ones before it lists any), unhealthy for one it no longer
    /// lists.
    fn healths(&self, view: &DriverView) -> Healths {
        let (health, message) = health_of(view);
        let listed: Option<Vec<u32>> = self.gpus.borrow().as_ref().map(|inventory| inventory.gpus.iter().map(|gpu| gpu.index).collect());
        let mut known = self.known.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        known.extend(listed.iter().flatten().copied());
        known
            .iter()
            .map(|&gpu| match &listed {
                Some(listed) if !listed.contains(&gpu) => (gpu, HealthStatus::Unhealthy, format!("NVML no longer lists GPU {gpu} (off the bus, or its driver failed)")),
                _ => (gpu, health, message.clone()),
            })
            .collect()
    }

    fn message(&self, healths: &Healths) -> NodeWatchResourcesResponse {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let devices = healths
            .iter()
            .map(|(gpu, health, message)| DeviceHealth {
                device: Some(DeviceIdentifier { pool_name: self.pool.clone(), device_name: device_name(*gpu) }),
                health: *health as i32,
                last_updated_time: i64::try_from(now).unwrap_or(i64::MAX),
                health_check_timeout_seconds: TIMEOUT.as_secs() as i64,
                message: message.clone(),
            })
            .collect();
        NodeWatchResourcesResponse { devices }
    }
}

type Watch = Pin<Box<dyn Stream<Item = Result<NodeWatchResourcesResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DraResourceHealth for Arc<Health> {
    type NodeWatchResourcesStream = Watch;

    async fn node_watch_resources(&self, _: Request<NodeWatchResourcesRequest>) -> Result<Response<Watch>, Status> {
        let (sender, receiver) = mpsc::channel(1);
        let (health, mut driver) = (self.clone(), self.driver.clone());
        // The watch's own task: it ends when the kubelet drops the stream (or the driver task
        // is gone).
        tokio::spawn(async move {
            let mut sent = health.healths(&driver.borrow_and_update());
            loop {
                if sender.send(Ok(health.message(&sent))).await.is_err() {
                    return;
                }
                let resend = tokio::time::sleep(RESEND);
                tokio::pin!(resend);
                loop {
                    tokio::select! {
                        changed = driver.changed() => {
                            if changed.is_err() {
                                return;
                            }
                            let now = health.healths(&driver.borrow_and_update());
                            if now != sent {
                                sent = now;
                                break;
                            }
                        }
                        () = &mut resend => break,
                        () = sender.closed() => return,
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(receiver))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::DriverStatus;
    use tokio_stream::StreamExt;

    fn view(state: State, reason: Option<&str>) -> Arc<DriverView> {
        Arc::new(DriverView { status: DriverStatus { state, reason: reason.map(str::to_owned), ..DriverStatus::default() }, ..DriverView::default() })
    }

    async fn next(stream: &mut Watch) -> NodeWatchResourcesResponse {
        stream.next().await.expect("a message").expect("not an error")
    }

    #[tokio::test]
    async fn the_gpus_are_healthy_while_nvml_answers_and_unhealthy_when_it_fails() {
        let (driver_tx, driver) = watch::channel(view(State::Starting, None));
        // GPUs 0 and 3 (minor numbers need not be dense).
        let mut listed = crate::inventory::from_flag(&[1 << 30; 4], 0);
        listed.gpus.retain(|gpu| gpu.index == 0 || gpu.index == 3);
        let (gpus_tx, gpus) = watch::channel(Some(Arc::new(listed.clone())));
        let health = Arc::new(Health { pool: "node-1".into(), gpus, known: Default::default(), driver });
        let mut stream = health.node_watch_resources(Request::new(NodeWatchResourcesRequest {})).await.expect("a watch").into_inner();
        let first = next(&mut stream).await;
        assert_eq!(first.devices.len(), 2);
        assert!(first.devices.iter().all(|d| d.health == HealthStatus::Unknown as i32), "{first:?}");
        driver_tx.send(view(State::Ok, None)).expect("watched");
        let healthy = next(&mut stream).await;
        let names: Vec<_> = healthy.devices.iter().map(|d| d.device.clone().expect("an id").device_name).collect();
        assert_eq!(names, ["gpu-0", "gpu-3"], "the inventory's GPUs");
        assert!(healthy.devices.iter().all(|d| d.health == HealthStatus::Healthy as i32 && d.device.as_ref().is_some_and(|i| i.pool_name == "node-1")));
        assert!(healthy.devices.iter().all(|d| d.health_check_timeout_seconds == 60 && d.last_updated_time > 0));
        // The same health again is no news; a failure is.
        driver_tx.send(view(State::Ok, None)).expect("watched");
        driver_tx.send(view(State::Failing, Some("nvmlDeviceGetCount: Unknown Error"))).expect("watched");
        let failing = next(&mut stream).await;
        assert!(failing.devices.iter().all(|d| d.health == HealthStatus::Unhealthy as i32), "{failing:?}");
        assert_eq!(failing.devices[0].message, "NVML is failing: nvmlDeviceGetCount: Unknown Error");
        driver_tx.send(view(State::Hung, Some("a read has not returned"))).expect("watched");
        assert!(next(&mut stream).await.devices.iter().all(|d| d.health == HealthStatus::Unhealthy as i32 && d.message.contains("hung")));
        // NVML answers again without GPU 3: it stays in the list, unhealthy.
        listed.gpus.retain(|gpu| gpu.index == 0);
        gpus_tx.send_replace(Some(Arc::new(listed)));
        driver_tx.send(view(State::Ok, None)).expect("watched");
        let lost = next(&mut stream).await;
        let states: Vec<(String, i32)> = lost.devices.iter().map(|d| (d.device.clone().expect("an id").device_name, d.health)).collect();
        assert_eq!(states, [("gpu-0".to_owned(), HealthStatus::Healthy as i32), ("gpu-3".to_owned(), HealthStatus::Unhealthy as i32)]);
        assert_eq!(lost.devices[1].message, "NVML no longer lists GPU 3 (off the bus, or its driver failed)");
    }

    #[tokio::test]
    async fn before_nvml_answers_the_known_gpus_are_listed() {
        let (_driver_tx, driver) = watch::channel(view(State::Failing, Some("init failed")));
        let health = Arc::new(Health { pool: "n".into(), gpus: crate::inventory::fixed(None), known: std::sync::Mutex::new([0, 5].into()), driver });
        let mut stream = health.node_watch_resources(Request::new(NodeWatchResourcesRequest {})).await.expect("a watch").into_inner();
        let first = next(&mut stream).await;
        assert_eq!(first.devices.iter().map(|d| (d.device.clone().expect("id").device_name, d.health)).collect::<Vec<_>>(), [("gpu-0".to_owned(), HealthStatus::Unhealthy as i32), ("gpu-5".to_owned(), HealthStatus::Unhealthy as i32)]);
    }
}
