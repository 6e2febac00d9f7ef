//! The webhook's counters, served on its `--metrics-addr` (`/metrics`):
//!
//! | family | counts |
//! |---|---|
//! | `vramguard_webhook_reviews_total{result}` | AdmissionReviews by how they were answered: `mutated`, `untouched` (nothing to convert, or not a pod's creation), `denied` (an invalid quantity, a clash), `failed` (a template could not be made sure of: the pod is refused), `bad_request` (400: not an AdmissionReview) |
//! | `vramguard_webhook_templates_total{outcome}` | ResourceClaimTemplates made sure of: `existing`, `created`, `differs` (a template of that name asks for something else), `capped` (past the creations' cap a minute: the pod is refused), `error` (the API failed or did not answer in time) |
//! | `vramguard_webhook_connections_total{outcome}` | connections to `--listen` by how they ended: `answered`, `closed`, `refused` (past the cap), `evicted` (idle past the cap), `tls_failed` (the handshake), `timed_out`, `bad_request`, `error` |
//! | `vramguard_webhook_certificate_reloads_total{result}` | changes of the TLS files: `loaded`, `failed` (the previous pair is still served) |
//! | `vramguard_webhook_certificate_events_total{event}` | with `--manage-certificate`, the Secret's and the configuration's writes: `created` (no Secret), `adopted` (a valid one found at the start), `renewed` (a serving pair near its end), `repaired` (a broken Secret rewritten), `ca_rotated` (a CA near its end), `ca_bundle` (the configuration's `caBundle` written), `failed` (a pass that could not finish: the pair served stays) |
//! | `vramguard_webhook_review_seconds` | time to answer a review (the template calls included) |
use anyhow::Result;
use prometheus::{Histogram, HistogramOpts, IntCounterVec, Opts, Registry};

/// The families, registered in the webhook's registry.
#[derive(Clone)]
pub struct WebhookMetrics {
    reviews: IntCounterVec,
    templates: IntCounterVec,
    connections: IntCounterVec,
    reloads: IntCounterVec,
    certificates: IntCounterVec,
    seconds: Histogram,
}

/// Every label value of each family, shown at zero from the start.
const REVIEWS: [&str; 5] = ["mutated", "untouched", "denied", "failed", "bad_request"];
const TEMPLATES: [&str; 5] = ["existing", "created", "differs", "capped", "error"];
pub const CONNECTIONS: [&str; 8] = ["answered", "closed", "refused", "evicted", "tls_failed", "timed_out", "bad_request", "error"];
const RELOADS: [&str; 2] = ["loaded", "failed"];
const CERTIFICATES: [&str; 7] = ["created", "adopted", "renewed", "repaired", "ca_rotated", "ca_bundle", "failed"];

fn family(registry: &Registry, name: &str, help: &str, label: &str, values: &[&str]) -> Result<IntCounterVec> {
    let counter = IntCounterVec::new(Opts::new(name, help), &[label])?;
    for value in values {
        counter.with_label_values(&[*value]);
    }
    registry.register(Box::new(counter.clone()))?;
    Ok(counter)
}

impl WebhookMetrics {
    pub fn new(registry: &Registry) -> Result<WebhookMetrics> {
        let seconds = Histogram::with_opts(
            HistogramOpts::new("vramguard_webhook_review_seconds", "Time to answer an AdmissionReview, the template calls included")
                .buckets(vec![0.001, 0.005, 0.025, 0.1, 0.5, 2.0, 10.0]),
        )?;
        registry.register(Box::new(seconds.clone()))?;
        Ok(WebhookMetrics {
            reviews: family(registry, "vramguard_webhook_reviews_total", "AdmissionReviews by result: mutated, untouched, denied, failed, bad_request", "result", &REVIEWS)?,
            templates: family(registry, "vramguard_webhook_templates_total", "ResourceClaimTemplates made sure of: existing, created, differs, capped, error", "outcome", &TEMPLATES)?,
            connections: family(
                registry,
                "vramguard_webhook_connections_total",
                "Connections to the webhook's listener by how they ended",
                "outcome",
                &CONNECTIONS,
            )?,
            reloads: family(registry, "vramguard_webhook_certificate_reloads_total", "Changes of the TLS files: loaded, failed", "result", &RELOADS)?,
            certificates: family(
                registry,
                "vramguard_webhook_certificate_events_total",
                "With --manage-certificate, the Secret's and caBundle's writes: created, adopted, renewed, repaired, ca_rotated, ca_bundle, failed",
                "event",
                &CERTIFICATES,
            )?,
            seconds,
        })
    }

    pub fn review(&self, result: &str, seconds: f64) {
        self.reviews.with_label_values(&[result]).inc();
        self.seconds.observe(seconds);
    }

    pub fn template(&self, outcome: &str) {
        self.templates.with_label_values(&[outcome]).inc();
    }

    pub fn connection(&self, outcome: &str) {
        self.connections.with_label_values(&[outcome]).inc();
    }

    pub fn reload(&self, result: &str) {
        self.reloads.with_label_values(&[result]).inc();
    }

    pub fn certificate(&self, event: &str) {
        self.certificates.with_label_values(&[event]).inc();
    }

    #[cfg(test)]
    pub fn reviews(&self, result: &str) -> u64 {
        self.reviews.with_label_values(&[result]).get()
    }
}
