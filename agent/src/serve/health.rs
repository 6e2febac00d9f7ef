//! `--health-addr`: `/healthz` and `/readyz` on a listener of their own (the DaemonSet's
//! probes point there), answered from words the tasks keep current and nothing else: no
//! page to render, no pass, no ledger, no lock a task holds while it works. A scrape, a slow
//! metrics reader or a tenant that makes a pass expensive cannot delay them.
//!
//! `/healthz` fails (503, naming the tasks) once a task has not come round its loop for
//! longer than it is allowed ([`crate::task::Liveness`]): the kernel task and the reclaim task
//! are allowed seconds; the reconcile and discovery tasks, whose steps tenants can lengthen
//! within their budgets, minutes (they fail health only when really stuck). `/readyz` fails
//! until the agent has started and while it is not ready (nothing probed, NRI not connected,
//! the node's pods not listed).
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Response, StatusCode};

use super::http::text;
use crate::task::Liveness;

/// Why the agent is not ready (`None`: ready); asked at each `/readyz`.
pub type Readiness = Box<dyn Fn() -> Option<&'static str> + Send + Sync>;

/// What the health listener answers from.
#[derive(Clone)]
pub struct Health {
    pub liveness: Liveness,
    /// Set once the agent's tasks run.
    pub ready: Arc<OnceLock<Readiness>>,
}

impl Health {
    pub fn new(liveness: Liveness) -> Health {
        Health { liveness, ready: Arc::new(OnceLock::new()) }
    }

    /// The answer for `path` (`/healthz` or `/readyz`).
    pub fn answer(&self, path: &str) -> Response<Full<Bytes>> {
        if path == "/healthz" {
            let stuck = self.liveness.stuck();
            if stuck.is_empty() {
                return text(StatusCode::OK, "ok\n");
            }
            let named: Vec<String> = stuck.iter().map(|(task, silent)| format!("{task} ({} s)", silent.as_secs())).collect();
            return text(StatusCode::SERVICE_UNAVAILABLE, format!("stuck: {}\n", named.join(", ")));
        }
        match self.ready.get().map(|ready| ready()) {
            None => text(StatusCode::SERVICE_UNAVAILABLE, "starting\n"),
            Some(Some(reason)) => text(StatusCode::SERVICE_UNAVAILABLE, format!("{reason}\n")),
            Some(None) => text(StatusCode::OK, "ready\n"),
        }
    }
}

/// The tasks' liveness in the text exposition format, made at each scrape of `/metrics` (not
/// by the reconcile task, whose page would stop moving with it):
/// `vramguard_task_silent_seconds{task}` (since the task last came round its loop) beside
/// `vramguard_task_allowed_seconds{task}` (past which `/healthz` fails).
pub fn exposition(liveness: &Liveness) -> Result<Vec<u8>, prometheus::Error> {
    let registry = prometheus::Registry::new();
    let silent = prometheus::GaugeVec::new(
        prometheus::Opts::new("vramguard_task_silent_seconds", "How long each of the agent's tasks has not come round its loop"),
        &["task"],
    )?;
    let allowed = prometheus::GaugeVec::new(
        prometheus::Opts::new("vramguard_task_allowed_seconds", "How long each task may stay silent before /healthz fails"),
        &["task"],
    )?;
    for (task, silent_for, allowed_for) in liveness.beats() {
        silent.with_label_values(&[task]).set(silent_for.as_secs_f64());
        allowed.with_label_values(&[task]).set(allowed_for.as_secs_f64());
    }
    registry.register(Box::new(silent))?;
    registry.register(Box::new(allowed))?;
    let mut page = Vec::new();
    prometheus::Encoder::encode(&prometheus::TextEncoder::new(), &registry.gather(), &mut page)?;
    Ok(page)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http_body_util::BodyExt;

    use super::*;

    async fn body(response: Response<Full<Bytes>>) -> (StatusCode, String) {
        let status = response.status();
        let bytes = response.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        (status, String::from_utf8_lossy(&bytes).into_owned())
    }

    #[tokio::test]
    async fn health_names_the_stuck_task_and_readiness_waits_for_the_start() {
        let liveness = Liveness::new();
        let health = Health::new(liveness.clone());
        assert_eq!(body(health.answer("/healthz")).await, (StatusCode::OK, "ok\n".into()));
        assert_eq!(body(health.answer("/readyz")).await, (StatusCode::SERVICE_UNAVAILABLE, "starting\n".into()));
        let _ = health.ready.set(Box::new(|| None));
        assert_eq!(body(health.answer("/readyz")).await, (StatusCode::OK, "ready\n".into()));
        let kernel = liveness.register("kernel", Duration::from_millis(20));
        tokio::time::sleep(Duration::from_millis(40)).await;
        let (status, text) = body(health.answer("/healthz")).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(text.starts_with("stuck: kernel"), "{text}");
        kernel.beat();
        assert_eq!(body(health.answer("/healthz")).await.0, StatusCode::OK);
    }
}
