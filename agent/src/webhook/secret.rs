//! `--manage-certificate`: the webhook keeps its own CA and serving pair in a Secret
//! (`--tls-secret`, the one truth the replicas share) and the CA in its
//! MutatingWebhookConfiguration's `caBundle` (`--webhook-configuration`), without cert-manager
//! or openssl.
//!
//! [`Managed::ensure`] reads the Secret and checks its pair ([`pki::check`]) for the Service's
//! DNS names (`--service` in the Secret's namespace, [`pki::dns_names`]):
//!
//! - absent: a new CA and pair are made and the Secret created; on `409` (another replica
//!   created it first) the Secret is read again and that one is used;
//! - valid and not due: used as it is (the second replica adopts the first one's);
//! - its serving pair due ([`pki::Lifetimes::serving_renew_before`]) or broken (unreadable,
//!   key not the certificate's, a name missing, not signed by the CA, expired): a new pair from
//!   the same CA; its CA due or broken: a new CA and pair (a CA that is due stays in `ca.crt`
//!   after the new one, trusted until it ends, so that replicas still serving a pair it signed
//!   are not refused); either written by an update carrying the `resourceVersion` read, and on
//!   `409` (someone wrote in between) read and checked again.
//!
//! Then the `caBundle` of every webhook of the configuration is made `ca.crt` (a JSON patch of
//! those that differ, at the `resourceVersion` read), and only then is the pair served (the
//! configuration trusts a new CA before any replica serves a pair it signed). At the start a
//! Secret that cannot be made sure of fails the start (after a few tries); a configuration that
//! does not exist yet is logged and tried again. Then every `--certificate-check-every` the
//! same again: a renewal by another replica, a repair of a Secret someone broke, a `caBundle`
//! someone changed are all seen within that time, and the served pair is swapped without a
//! restart. Each write is logged and counted in
//! `vramguard_webhook_certificate_events_total{event}`.
use std::{collections::BTreeMap, sync::Arc, time::Duration};

use anyhow::{bail, Context, Result};
use k8s_openapi::{
    api::{admissionregistration::v1::MutatingWebhookConfiguration, core::v1::Secret},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
    ByteString,
};
use kube::{
    api::{Patch, PatchParams, PostParams},
    Api, Client,
};
use tracing::{info, warn};

use super::{
    metrics::WebhookMetrics,
    pki::{self, Bundle, Lifetimes, Verdict},
    templates::{FIELD_MANAGER, MANAGED_BY},
    tls::Certificates,
};
use crate::provision::kube::KubeError;

/// The Secret's keys.
pub const CA_CRT: &str = "ca.crt";
pub const CA_KEY: &str = "ca.key";
pub const TLS_CRT: &str = "tls.crt";
pub const TLS_KEY: &str = "tls.key";
/// How many times a write lost to another writer is tried again within one pass.
const TRIES: usize = 5;

/// Where the certificate is kept and for what.
#[derive(Clone, Debug)]
pub struct Place {
    pub namespace: String,
    pub secret: String,
    pub service: String,
    pub configuration: String,
}

/// The Secret and the configuration, reached through the API.
pub struct Managed {
    secrets: Api<Secret>,
    configurations: Api<MutatingWebhookConfiguration>,
    place: Place,
    names: Vec<String>,
    lifetimes: Lifetimes,
    deadline: Duration,
    metrics: WebhookMetrics,
}

/// `NAMESPACE/NAME` split.
pub fn parse_secret(text: &str) -> Result<(String, String)> {
    match text.split_once('/') {
        Some((namespace, name)) if !namespace.is_empty() && !name.is_empty() && !name.contains('/') => Ok((namespace.to_owned(), name.to_owned())),
        _ => bail!("--tls-secret {text:?}: expected NAMESPACE/NAME"),
    }
}

fn bundle_of(secret: &Secret) -> Bundle {
    let data = secret.data.clone().unwrap_or_default();
    let key = |k: &str| data.get(k).map(|b| b.0.clone()).unwrap_or_default();
    Bundle { ca_crt: key(CA_CRT), ca_key: key(CA_KEY), tls_crt: key(TLS_CRT), tls_key: key(TLS_KEY) }
}

fn data_of(bundle: &Bundle) -> BTreeMap<String, ByteString> {
    BTreeMap::from([
        (CA_CRT.to_owned(), ByteString(bundle.ca_crt.clone())),
        (CA_KEY.to_owned(), ByteString(bundle.ca_key.clone())),
        (TLS_CRT.to_owned(), ByteString(bundle.tls_crt.clone())),
        (TLS_KEY.to_owned(), ByteString(bundle.tls_key.clone())),
    ])
}

/// The JSON patch that sets every webhook's `caBundle` to `ca_crt` (`None`: all do already),
/// the configuration's `resourceVersion` in it: the API server applies it only to the version
/// read (`409` otherwise), so the webhooks' indexes are the ones read. A patch, not an
/// update: fields of the configuration this client's types do not know are left alone.
fn ca_bundle_patch(configuration: &MutatingWebhookConfiguration, ca_crt: &[u8]) -> Option<json_patch::Patch> {
    use base64::Engine as _;
    let bundle = base64::engine::general_purpose::STANDARD.encode(ca_crt);
    let mut operations: Vec<serde_json::Value> = configuration
        .webhooks
        .iter()
        .flatten()
        .enumerate()
        .filter(|(_, webhook)| webhook.client_config.ca_bundle.as_ref().map(|b| b.0.as_slice()) != Some(ca_crt))
        .map(|(i, _)| serde_json::json!({"op": "add", "path": format!("/webhooks/{i}/clientConfig/caBundle"), "value": bundle}))
        .collect();
    if operations.is_empty() {
        return None;
    }
    let version = configuration.metadata.resource_version.clone().unwrap_or_default();
    operations.push(serde_json::json!({"op": "replace", "path": "/metadata/resourceVersion", "value": version}));
    serde_json::from_value(serde_json::Value::Array(operations)).ok()
}

fn conflict(error: &KubeError) -> bool {
    matches!(error, KubeError::Status { code: 409, .. })
}

impl Managed {
    pub fn new(client: Client, place: Place, lifetimes: Lifetimes, deadline: Duration, metrics: WebhookMetrics) -> Managed {
        let names = pki::dns_names(&place.service, &place.namespace);
        Managed {
            secrets: Api::namespaced(client.clone(), &place.namespace),
            configurations: Api::all(client),
            place,
            names,
            lifetimes,
            deadline,
            metrics,
        }
    }

    /// One API call, within the deadline.
    async fn call<T>(&self, what: String, call: impl std::future::Future<Output = kube::Result<T>>) -> Result<T, KubeError> {
        match tokio::time::timeout(self.deadline, call).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(error)) => Err(KubeError::from_kube(what, error)),
            Err(_) => Err(KubeError::Timeout { what, after: self.deadline }),
        }
    }

    fn event(&self, event: &str, why: &str) {
        self.metrics.certificate(event);
        info!(event, secret = %format!("{}/{}", self.place.namespace, self.place.secret), why, "webhook certificate: {event}");
    }

    /// The Secret's bundle, valid and not due, made so if it was not (`first`: a valid one
    /// found is counted as adopted).
    pub async fn ensure(&self, first: bool) -> Result<Bundle> {
        let name = &self.place.secret;
        let params = PostParams { dry_run: false, field_manager: Some(FIELD_MANAGER.into()) };
        for _ in 0..TRIES {
            let now = std::time::SystemTime::now();
            let Some(mut secret) = self.call(format!("reading Secret {name}"), self.secrets.get_opt(name)).await? else {
                let bundle = pki::new_bundle(&[], &self.names, &self.lifetimes, now)?;
                let secret = Secret {
                    metadata: ObjectMeta {
                        name: Some(name.clone()),
                        namespace: Some(self.place.namespace.clone()),
                        labels: Some(BTreeMap::from([(MANAGED_BY.0.to_owned(), MANAGED_BY.1.to_owned())])),
                        ..ObjectMeta::default()
                    },
                    type_: Some("kubernetes.io/tls".into()),
                    data: Some(data_of(&bundle)),
                    ..Secret::default()
                };
                match self.call(format!("creating Secret {name}"), self.secrets.create(&params, &secret)).await {
                    Ok(_) => {
                        self.event("created", "no Secret");
                        return Ok(bundle);
                    }
                    Err(error) if conflict(&error) => continue,
                    Err(error) => return Err(error.into()),
                }
            };
            let stored = bundle_of(&secret);
            let (bundle, event, why) = match pki::check(&stored, &self.names, &self.lifetimes, now) {
                Verdict::Good => {
                    if first {
                        self.event("adopted", "a valid pair");
                    }
                    return Ok(stored);
                }
                Verdict::Serving { why, expiring } => {
                    let renewed = pki::renew_serving(&stored, &self.names, &self.lifetimes, now)?;
                    // A CA that cannot sign a pair that checks (not one of ours): replaced.
                    if pki::check(&renewed, &self.names, &self.lifetimes, now) == Verdict::Good {
                        (renewed, if expiring { "renewed" } else { "repaired" }, why)
                    } else {
                        (pki::new_bundle(&[], &self.names, &self.lifetimes, now)?, "repaired", format!("{why}; its CA cannot sign a valid pair"))
                    }
                }
                Verdict::Ca { why, expiring } => {
                    let trusted = if expiring { pki::still_valid_pem(&stored.ca_crt, now) } else { Vec::new() };
                    (pki::new_bundle(&trusted, &self.names, &self.lifetimes, now)?, if expiring { "ca_rotated" } else { "repaired" }, why)
                }
            };
            secret.data = Some(data_of(&bundle));
            secret.string_data = None;
            match self.call(format!("updating Secret {name}"), self.secrets.replace(name, &params, &secret)).await {
                Ok(_) => {
                    self.event(event, &why);
                    return Ok(bundle);
                }
                Err(error) if conflict(&error) => continue,
                Err(error) => return Err(error.into()),
            }
        }
        bail!("Secret {}/{name}: another writer changed it {TRIES} times in a row", self.place.namespace)
    }

    /// Every webhook of the configuration trusts `ca_crt` (`Ok(false)`: no configuration).
    pub async fn ensure_ca_bundle(&self, ca_crt: &[u8]) -> Result<bool> {
        let name = &self.place.configuration;
        let params = PostParams { dry_run: false, field_manager: Some(FIELD_MANAGER.into()) };
        for _ in 0..TRIES {
            let Some(configuration) = self.call(format!("reading MutatingWebhookConfiguration {name}"), self.configurations.get_opt(name)).await? else {
                return Ok(false);
            };
            let Some(patch) = ca_bundle_patch(&configuration, ca_crt) else { return Ok(true) };
            let params = PatchParams { field_manager: params.field_manager.clone(), ..PatchParams::default() };
            let patch: Patch<()> = Patch::Json(patch);
            match self.call(format!("patching MutatingWebhookConfiguration {name}"), self.configurations.patch(name, &params, &patch)).await {
                Ok(_) => {
                    self.metrics.certificate("ca_bundle");
                    info!(configuration = %name, "webhook certificate: the caBundle is the Secret's CA");
                    return Ok(true);
                }
                Err(error) if conflict(&error) => continue,
                Err(error) => return Err(error.into()),
            }
        }
        bail!("MutatingWebhookConfiguration {name}: another writer changed it {TRIES} times in a row")
    }

    /// One pass: the Secret made sure of, the configuration's `caBundle`, then the pair
    /// served by `certificates` (if any yet).
    async fn pass(&self, first: bool) -> Result<Bundle> {
        let bundle = self.ensure(first).await?;
        match self.ensure_ca_bundle(&bundle.ca_crt).await {
            Ok(true) => {}
            Ok(false) => warn!(configuration = %self.place.configuration, "no MutatingWebhookConfiguration of that name yet: its caBundle is written once it exists"),
            Err(error) => {
                self.metrics.certificate("failed");
                warn!(error = format!("{error:#}"), "the webhook configuration's caBundle could not be written");
            }
        }
        Ok(bundle)
    }

    /// The first pass, tried up to [`TRIES`] times a second apart: the pair to serve.
    pub async fn start(&self) -> Result<Arc<Certificates>> {
        let mut last = None;
        for _ in 0..TRIES {
            match self.pass(true).await {
                Ok(bundle) => return Certificates::from_pem(&bundle.tls_crt, &bundle.tls_key),
                Err(error) => {
                    self.metrics.certificate("failed");
                    warn!(error = format!("{error:#}"), "the webhook's certificate could not be made sure of: trying again");
                    last = Some(error);
                }
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("no try"))).context("the webhook's certificate Secret")
    }

    /// A pass every `every`, for ever, the pair served swapped when the Secret's changes.
    pub async fn keep(self, certificates: Arc<Certificates>, every: Duration) {
        let mut ticks = tokio::time::interval(every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticks.tick().await;
        loop {
            ticks.tick().await;
            match self.pass(false).await {
                Ok(bundle) => match certificates.set(&bundle.tls_crt, &bundle.tls_key) {
                    Ok(false) => {}
                    Ok(true) => info!("serving the Secret's new TLS certificate"),
                    Err(error) => warn!(error = format!("{error:#}"), "the Secret's pair could not be served"),
                },
                Err(error) => {
                    self.metrics.certificate("failed");
                    warn!(error = format!("{error:#}"), "the webhook's certificate could not be made sure of: the pair served stays");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_names() {
        assert_eq!(parse_secret("vramguard-system/vramguard-webhook-tls").expect("ok"), ("vramguard-system".into(), "vramguard-webhook-tls".into()));
        for bad in ["", "name", "/name", "ns/", "a/b/c"] {
            assert!(parse_secret(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_ca_bundle_patch_sets_what_differs_at_the_version_read() {
        use k8s_openapi::api::admissionregistration::v1::{MutatingWebhook, WebhookClientConfig};
        let webhook = |name: &str, bundle: Option<&[u8]>| MutatingWebhook {
            name: name.into(),
            client_config: WebhookClientConfig { ca_bundle: bundle.map(|b| ByteString(b.to_vec())), ..WebhookClientConfig::default() },
            ..MutatingWebhook::default()
        };
        let mut configuration = MutatingWebhookConfiguration {
            metadata: ObjectMeta { name: Some("c".into()), resource_version: Some("42".into()), ..ObjectMeta::default() },
            webhooks: Some(vec![webhook("a", Some(b"CA")), webhook("b", None), webhook("c", Some(b"old"))]),
        };
        let patch = serde_json::to_value(ca_bundle_patch(&configuration, b"CA").expect("a patch")).expect("json");
        assert_eq!(
            patch,
            serde_json::json!([
                {"op": "add", "path": "/webhooks/1/clientConfig/caBundle", "value": "Q0E="},
                {"op": "add", "path": "/webhooks/2/clientConfig/caBundle", "value": "Q0E="},
                {"op": "replace", "path": "/metadata/resourceVersion", "value": "42"}
            ])
        );
        configuration.webhooks = Some(vec![webhook("a", Some(b"CA"))]);
        assert!(ca_bundle_patch(&configuration, b"CA").is_none());
    }

    #[test]
    fn data_round_trip() {
        let bundle = Bundle { ca_crt: b"a".to_vec(), ca_key: b"b".to_vec(), tls_crt: b"c".to_vec(), tls_key: b"d".to_vec() };
        let secret = Secret { data: Some(data_of(&bundle)), ..Secret::default() };
        assert_eq!(bundle_of(&secret), bundle);
        assert_eq!(bundle_of(&Secret::default()), Bundle::default());
    }
}
