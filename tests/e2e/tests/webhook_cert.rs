//! The admission webhook's own certificate (`vramguard webhook --manage-certificate`, issue 40
//! item 3), the real binary against the mock API server (`kube_api`): the first replica
//! creates the Secret (a CA and a serving pair) and writes the CA into the
//! MutatingWebhookConfiguration's `caBundle`, and a client that trusts only that CA completes a
//! handshake for the Service's DNS names; a second replica adopts the same Secret, and two that
//! start together end serving one; a pair near its end is renewed and served without a
//! restart; a Secret someone broke and a `caBundle` someone changed are repaired.
mod kube_api;

use std::{
    ffi::OsString,
    path::{Path, PathBuf},
    sync::Arc,
};

use anyhow::{Context, Result};
use e2e::webhook::Webhook;
use base64::Engine as _;
use kube_api::{
    objects::{SECRETS, WEBHOOK_CONFIGURATIONS},
    ApiServer,
};
use rustls::pki_types::{pem::PemObject, CertificateDer, ServerName};
use serde_json::{json, Value};

const NAMESPACE: &str = "vramguard-system";
const SECRET: &str = "vramguard-webhook-tls";
const CONFIGURATION: &str = "vramguard-webhook";
const SERVICE_NAME: &str = "vramguard-webhook.vramguard-system.svc";

/// `vramguard webhook --manage-certificate` with the test's names and a check every second,
/// and `more` arguments, its log `<dir>/<tag>.log`: started, not yet serving.
fn spawn(dir: &Path, tag: &str, api: &ApiServer, account: &Path, more: &[&str]) -> Result<Webhook> {
    let args: Vec<OsString> = [
        "--manage-certificate",
        "--tls-secret",
        &format!("{NAMESPACE}/{SECRET}"),
        "--service",
        "vramguard-webhook",
        "--webhook-configuration",
        CONFIGURATION,
        "--certificate-check-every",
        "1",
    ]
    .iter()
    .chain(more)
    .map(OsString::from)
    .collect();
    Webhook::spawn(dir.join(format!("{tag}.log")), api.addr.port(), account, &args)
}

/// [`spawn`], serving.
fn start(dir: &Path, tag: &str, api: &ApiServer, account: &Path, more: &[&str]) -> Result<Webhook> {
    spawn(dir, tag, api, account, more)?.serving()
}

/// What the tests ask of a webhook beside the kit's.
trait Certified {
    fn events(&self, event: &str) -> Result<u64>;
    fn handshake(&self, ca_pem: &[u8], name: &str) -> Result<Vec<u8>>;
}

impl Certified for Webhook {
    /// `vramguard_webhook_certificate_events_total{event}`.
    fn events(&self, event: &str) -> Result<u64> {
        Ok(self.sample(&format!("vramguard_webhook_certificate_events_total{{event=\"{event}\"}}"))? as u64)
    }

    /// The certificate it serves (DER) to a client that trusts only `ca_pem` and asks for
    /// `name`; an error if the handshake fails.
    fn handshake(&self, ca_pem: &[u8], name: &str) -> Result<Vec<u8>> {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        runtime.block_on(async {
            let mut roots = rustls::RootCertStore::empty();
            for cert in CertificateDer::pem_slice_iter(ca_pem) {
                roots.add(cert?)?;
            }
            let config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()?
                .with_root_certificates(roots)
                .with_no_client_auth();
            let tcp = tokio::net::TcpStream::connect(self.addr).await?;
            let connect = tokio_rustls::TlsConnector::from(Arc::new(config)).connect(ServerName::try_from(name.to_owned())?, tcp);
            let tls = tokio::time::timeout(e2e::timeout(), connect).await??;
            let served = tls.get_ref().1.peer_certificates().and_then(|c| c.first()).context("no certificate served")?;
            Ok(served.to_vec())
        })
    }
}

/// An API server with the webhook configuration (its caBundle a placeholder, as the manifest
/// before the webhook wrote it) and the service account's files under `dir`.
fn setup(dir: &Path) -> Result<(ApiServer, PathBuf)> {
    let api = ApiServer::start()?;
    let account = dir.join("account");
    api.service_account(&account)?;
    let webhook = |name: &str| {
        json!({
            "name": name, "admissionReviewVersions": ["v1"],
            "clientConfig": {"service": {"name": "vramguard-webhook", "namespace": NAMESPACE, "path": "/mutate", "port": 443}, "caBundle": "UExBQ0VIT0xERVI="},
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"], "scope": "Namespaced"}],
            "failurePolicy": "Fail", "sideEffects": "NoneOnDryRun", "timeoutSeconds": 10,
            // A field of a later Kubernetes than the webhook's client types know.
            "aFieldOfLater": {"kept": true}
        })
    };
    api.put_object(
        &WEBHOOK_CONFIGURATIONS,
        json!({
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": CONFIGURATION, "uid": "5f0c0000-0000-4000-8000-000000000001"},
            "webhooks": [webhook("gpu-memory.vramguard.io"), webhook("second.vramguard.io")]
        }),
    );
    Ok((api, account))
}

fn decode(value: &Value) -> Vec<u8> {
    value.as_str().and_then(|s| base64::engine::general_purpose::STANDARD.decode(s).ok()).unwrap_or_default()
}

/// The Secret: (resourceVersion, ca.crt, tls.crt), the texts decoded.
fn secret(api: &ApiServer) -> Result<(String, Vec<u8>, Vec<u8>)> {
    let secret = api.object(&SECRETS, NAMESPACE, SECRET).context("no Secret")?;
    let version = secret["metadata"]["resourceVersion"].as_str().unwrap_or_default().to_owned();
    Ok((version, decode(&secret["data"]["ca.crt"]), decode(&secret["data"]["tls.crt"])))
}

/// The caBundles of the configuration's webhooks, decoded.
fn ca_bundles(api: &ApiServer) -> Result<Vec<Vec<u8>>> {
    let configuration = api.object(&WEBHOOK_CONFIGURATIONS, "", CONFIGURATION).context("no configuration")?;
    Ok(configuration["webhooks"].as_array().into_iter().flatten().map(|w| decode(&w["clientConfig"]["caBundle"])).collect())
}

/// The first certificate of a PEM text, DER.
fn der(pem: &[u8]) -> Result<Vec<u8>> {
    Ok(CertificateDer::pem_slice_iter(pem).next().context("no certificate")??.to_vec())
}

#[test]
fn the_first_start_creates_the_secret_and_the_ca_bundle() -> Result<()> {
    let dir = e2e::TempDir::new("webhook-cert")?;
    let (api, account) = setup(dir.path())?;
    let webhook = start(dir.path(), "first", &api, &account, &[])?;
    let stored = api.object(&SECRETS, NAMESPACE, SECRET).context("no Secret")?;
    assert_eq!(stored["type"], "kubernetes.io/tls", "{stored}");
    for key in ["ca.crt", "ca.key", "tls.crt", "tls.key"] {
        assert!(!decode(&stored["data"][key]).is_empty(), "{key} in {stored}");
    }
    assert!(String::from_utf8_lossy(&decode(&stored["data"]["ca.key"])).contains("PRIVATE KEY"));
    let (_, ca, tls) = secret(&api)?;
    assert_eq!(ca_bundles(&api)?, vec![ca.clone(), ca.clone()], "every webhook's caBundle is the Secret's CA");
    for name in ["vramguard-webhook", "vramguard-webhook.vramguard-system", SERVICE_NAME, "vramguard-webhook.vramguard-system.svc.cluster.local"] {
        assert_eq!(webhook.handshake(&ca, name).with_context(|| format!("{name}: {}", webhook.log()))?, der(&tls)?, "{name}");
    }
    assert!(webhook.handshake(&ca, "other.vramguard-system.svc").is_err(), "a name not in the certificate");
    // The caBundle was patched: the rest of the configuration is as it was.
    let configuration = api.object(&WEBHOOK_CONFIGURATIONS, "", CONFIGURATION).context("configuration")?;
    assert_eq!(configuration["webhooks"][1]["aFieldOfLater"]["kept"], true, "{configuration}");
    assert_eq!(configuration["webhooks"][0]["failurePolicy"], "Fail", "{configuration}");
    let writes: Vec<String> = api.seen().iter().filter(|s| s.method != "GET").map(|s| format!("{} {}", s.method, s.target.split('?').next().unwrap_or_default())).collect();
    assert_eq!(
        writes,
        [
            "POST /api/v1/namespaces/vramguard-system/secrets",
            "PATCH /apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/vramguard-webhook"
        ],
        "one creation, one patch"
    );
    assert_eq!(webhook.events("created")?, 1);
    assert_eq!(webhook.events("ca_bundle")?, 1);
    assert_eq!(webhook.events("adopted")?, 0);
    // Nothing to do on the next passes: no more writes.
    let seen = api.seen().iter().filter(|s| s.method != "GET").count();
    std::thread::sleep(std::time::Duration::from_secs(3));
    assert_eq!(api.seen().iter().filter(|s| s.method != "GET").count(), seen, "{}", webhook.log());
    Ok(())
}

#[test]
fn a_second_replica_adopts_the_secret_and_two_at_once_end_with_one() -> Result<()> {
    let dir = e2e::TempDir::new("webhook-cert")?;
    let (api, account) = setup(dir.path())?;
    let first = start(dir.path(), "first", &api, &account, &[])?;
    let (version, ca, tls) = secret(&api)?;
    let second = start(dir.path(), "second", &api, &account, &[])?;
    assert_eq!(secret(&api)?, (version, ca.clone(), tls.clone()), "the second replica wrote nothing");
    assert_eq!(second.handshake(&ca, SERVICE_NAME)?, der(&tls)?);
    assert_eq!(first.handshake(&ca, SERVICE_NAME)?, der(&tls)?);
    assert_eq!((second.events("adopted")?, second.events("created")?), (1, 0));
    drop((first, second));

    // Two replicas started together against an API server without the Secret.
    let (api, account) = setup(&dir.path().join("race"))?;
    let (one, two) = (spawn(dir.path(), "one", &api, &account, &[])?, spawn(dir.path(), "two", &api, &account, &[])?);
    let (one, two) = (one.serving()?, two.serving()?);
    let (_, ca, tls) = secret(&api)?;
    assert_eq!(one.handshake(&ca, SERVICE_NAME)?, der(&tls)?, "{}", one.log());
    assert_eq!(two.handshake(&ca, SERVICE_NAME)?, der(&tls)?, "{}", two.log());
    assert_eq!(one.events("created")? + two.events("created")?, 1);
    assert_eq!(ca_bundles(&api)?, vec![ca.clone(), ca]);
    drop((one, two));

    // The race made certain: another replica's Secret lands between this one's read (none)
    // and its create, which gets 409; it reads that Secret and serves it.
    let theirs = api.object(&SECRETS, NAMESPACE, SECRET).context("Secret")?;
    let (api, account) = setup(&dir.path().join("lost"))?;
    api.interpose(&SECRETS, theirs.clone());
    let late = start(dir.path(), "late", &api, &account, &[])?;
    assert!(!api.interposing(), "the other replica's Secret was written");
    let (_, ca, tls) = secret(&api)?;
    assert_eq!((ca.clone(), tls.clone()), (decode(&theirs["data"]["ca.crt"]), decode(&theirs["data"]["tls.crt"])), "the winner's Secret kept");
    assert_eq!(late.handshake(&ca, SERVICE_NAME)?, der(&tls)?);
    assert_eq!((late.events("created")?, late.events("adopted")?), (0, 1));
    let secrets: Vec<String> = api.seen().iter().filter(|s| s.target.contains("/secrets")).map(|s| s.method.clone()).collect();
    assert_eq!(secrets[..3], ["GET", "POST", "GET"], "read, create (409), read again: {secrets:?}");
    assert_eq!(ca_bundles(&api)?, vec![ca.clone(), ca]);
    Ok(())
}

#[test]
fn a_pair_near_its_end_is_renewed_and_served_without_a_restart() -> Result<()> {
    let dir = e2e::TempDir::new("webhook-cert")?;
    let (api, account) = setup(dir.path())?;
    // A pair of 20 s renewed 15 s before its end: every 5 s.
    let webhook = start(dir.path(), "renewing", &api, &account, &["--certificate-validity", "20", "--certificate-renew-before", "15"])?;
    let (version, ca, tls) = secret(&api)?;
    assert_eq!(webhook.handshake(&ca, SERVICE_NAME)?, der(&tls)?);
    e2e::wait_for(e2e::timeout(), "the Secret's pair renewed", || Ok(secret(&api)?.0 != version)).with_context(|| webhook.log())?;
    let (_, renewed_ca, _) = secret(&api)?;
    assert_eq!(renewed_ca, ca, "the same CA signs the renewed pair");
    e2e::wait_for(e2e::timeout(), "the renewed pair served", || {
        let served = webhook.handshake(&ca, SERVICE_NAME)?;
        Ok(served != der(&tls)? && served == der(&secret(&api)?.2)?)
    })
    .with_context(|| webhook.log())?;
    assert!(webhook.events("renewed")? >= 1);
    assert_eq!(webhook.events("repaired")?, 0);
    assert!(webhook.log().contains("renewed"), "{}", webhook.log());
    drop(webhook);

    // A CA of 40 s replaced 32 s before its end: a new CA and pair, the old CA still trusted
    // beside the new one (in ca.crt and every caBundle) until it ends.
    let (api, account) = setup(&dir.path().join("ca"))?;
    let lifetimes = ["--ca-validity", "40", "--ca-renew-before", "32", "--certificate-validity", "3600", "--certificate-renew-before", "10"];
    let webhook = start(dir.path(), "rotating", &api, &account, &lifetimes)?;
    let (_, first_ca, _) = secret(&api)?;
    e2e::wait_for(e2e::timeout(), "the CA replaced, the old one still trusted", || {
        let (_, ca, tls) = secret(&api)?;
        let cas: Vec<Vec<u8>> = CertificateDer::pem_slice_iter(&ca).map(|c| Ok(c?.to_vec())).collect::<Result<_>>()?;
        let newest = cas[0].clone();
        let newest_pem = format!("-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n", base64::engine::general_purpose::STANDARD.encode(&newest));
        Ok(cas.len() >= 2
            && cas.contains(&der(&first_ca)?)
            && ca_bundles(&api)? == vec![ca.clone(), ca.clone()]
            && webhook.handshake(newest_pem.as_bytes(), SERVICE_NAME).ok() == Some(der(&tls)?)
            && webhook.handshake(&first_ca, SERVICE_NAME).is_err())
    })
    .with_context(|| webhook.log())?;
    assert!(webhook.events("ca_rotated")? >= 1);
    Ok(())
}

#[test]
fn a_secret_someone_broke_and_a_changed_ca_bundle_are_repaired() -> Result<()> {
    let dir = e2e::TempDir::new("webhook-cert")?;
    let (api, account) = setup(dir.path())?;
    // A Secret of someone else's, all garbage, there before the start: replaced at the start.
    api.put_object(
        &SECRETS,
        json!({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
               "metadata": {"name": SECRET, "namespace": NAMESPACE, "uid": "0b1e0000-0000-4000-8000-00000000000a"},
               "data": {"ca.crt": "Z2FyYmFnZQ==", "tls.crt": "Z2FyYmFnZQ=="}}),
    );
    let webhook = start(dir.path(), "repairing", &api, &account, &[])?;
    let (_, ca, tls) = secret(&api)?;
    assert_eq!(webhook.handshake(&ca, SERVICE_NAME)?, der(&tls)?);
    assert_eq!(ca_bundles(&api)?, vec![ca.clone(), ca.clone()]);
    assert_eq!(api.object(&SECRETS, NAMESPACE, SECRET).context("Secret")?["type"], "Opaque", "the type is immutable: kept");
    assert_eq!(webhook.events("repaired")?, 1);

    // Garbage in tls.crt while it runs: a new pair from the same CA, served.
    let mut broken = api.object(&SECRETS, NAMESPACE, SECRET).context("Secret")?;
    broken["data"]["tls.crt"] = json!("bm90IGEgY2VydGlmaWNhdGU=");
    api.put_object(&SECRETS, broken);
    e2e::wait_for(e2e::timeout(), "the Secret repaired", || Ok(der(&secret(&api)?.2).is_ok())).with_context(|| webhook.log())?;
    let (_, repaired_ca, repaired) = secret(&api)?;
    assert_eq!(repaired_ca, ca);
    e2e::wait_for(e2e::timeout(), "the repaired pair served", || Ok(webhook.handshake(&ca, SERVICE_NAME)? == der(&repaired)?)).with_context(|| webhook.log())?;
    assert_eq!(webhook.events("repaired")?, 2);

    // Broken again, and another replica repairs it between this one's read and its update:
    // the update meets a stale resourceVersion (409), the Secret is read again, found valid
    // and served as it is (the other replica's repair is not overwritten).
    let good = api.object(&SECRETS, NAMESPACE, SECRET).context("Secret")?;
    let mut broken = good.clone();
    broken["data"]["tls.key"] = json!("bm90IGEga2V5");
    api.interpose(&SECRETS, good.clone());
    let before = api.seen().len();
    api.put_object(&SECRETS, broken);
    e2e::wait_for(e2e::timeout(), "the interposed write met", || Ok(!api.interposing())).with_context(|| webhook.log())?;
    e2e::wait_for(e2e::timeout(), "the Secret read again", || Ok(api.seen()[before..].iter().filter(|s| s.target.contains("/secrets/")).count() >= 3))?;
    std::thread::sleep(std::time::Duration::from_secs(2));
    let (_, after_ca, after_tls) = secret(&api)?;
    assert_eq!((after_ca, after_tls.clone()), (decode(&good["data"]["ca.crt"]), decode(&good["data"]["tls.crt"])), "{}", webhook.log());
    let puts = api.seen()[before..].iter().filter(|s| s.method == "PUT" && s.target.contains("/secrets/")).count();
    assert_eq!(puts, 1, "one update, refused; none after: {}", webhook.log());
    assert_eq!(webhook.events("repaired")?, 2, "the lost update is not counted");
    assert_eq!(webhook.handshake(&ca, SERVICE_NAME)?, der(&after_tls)?);

    // A caBundle someone changed: the Secret's CA again.
    let mut configuration = api.object(&WEBHOOK_CONFIGURATIONS, "", CONFIGURATION).context("configuration")?;
    configuration["webhooks"][1]["clientConfig"]["caBundle"] = json!("Zm9v");
    api.put_object(&WEBHOOK_CONFIGURATIONS, configuration);
    e2e::wait_for(e2e::timeout(), "the caBundle written again", || Ok(ca_bundles(&api)? == vec![ca.clone(), ca.clone()])).with_context(|| webhook.log())?;
    Ok(())
}
