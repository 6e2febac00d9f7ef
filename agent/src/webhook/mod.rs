//! `vramguard webhook`: the mutating admission webhook that keeps `vramguard.io/gpu-memory:
//! 8Gi` working on a cluster that places quotas with DRA (`--dra`, [`crate::dra`]). The same
//! binary as the node agent, run by a Deployment of its own (`deploy/kubernetes/dra/webhook.yaml`);
//! it loads no eBPF, touches no node and needs no privilege.
//!
//! This room owns the conversion of a pod's extended resource into DRA claims
//! ([`mutate`], pure), the ResourceClaimTemplates the converted pods name ([`templates`], the
//! webhook's only writes besides its certificate's), the AdmissionReview protocol ([`review`]), the HTTPS listener and
//! its limits ([`server`]), its certificate and its reload ([`tls`]), or with
//! `--manage-certificate` its own CA and pair kept in a Secret and its configuration's
//! `caBundle` ([`secret`], [`pki`]), and its counters
//! ([`metrics`]; served on `--metrics-addr` with `/healthz` and `/readyz`).
//!
//! # The scheme, and why
//!
//! A mutating webhook can only patch the pod it admits; a pod names claims either by an
//! existing ResourceClaim (`resourceClaimName`) or by a ResourceClaimTemplate
//! (`resourceClaimTemplateName`) from which the control plane's resourceclaim controller
//! makes a claim for that pod, owned by it (deleted with it).
//!
//! HAMi-DRA's webhook creates a ResourceClaim per container (named after the namespace, pod
//! and container, or a random string when the pod has only a `generateName`) through the API
//! server before it answers and names it by `resourceClaimName`. That claim belongs to no
//! one (the pod has no UID yet at admission): it outlives the pod unless something else
//! deletes it, a pod of a ReplicaSet gets a random name for it, and a pod refused by a later
//! admission step leaves it behind.
//!
//! Here the webhook makes sure, through the API server, that the namespace has a template
//! per distinct shape, `vramguard-gpu-memory-<size>` ([`mutate::template_name`]: one device
//! of DeviceClass `gpu.vramguard.io`, `allocationMode: ExactCount, count: 1, capacity:
//! {requests: {memory: <size>}}`; `...-<size>-x<N>` with `count: N` for a container that
//! also asks `nvidia.com/gpu: N`, [`mutate::Shape`]), and patches the pod: a pod claim per
//! main container that asked (`vramguard-<container>`, from its shape's template), named in
//! that container's `resources.claims`, and `vramguard.io/gpu-memory` (and `nvidia.com/gpu`
//! beside it, which NVIDIA's device plugin would otherwise also allocate) removed from its
//! limits and requests. Init containers too: a sidecar gets its own claim; an ordinary one,
//! which runs before the main containers, names a main container's claim that holds it, or
//! one it shares with the other init containers ([`mutate::share`]). Claims are then made,
//! owned and deleted by Kubernetes with the pod, as for any templated claim; the webhook's
//! writes are a handful of small immutable objects per namespace, idempotent (an existing
//! template with the same spec is used as it is; one that asks for something else refuses
//! the pod, never overwritten), and none per pod. Containers that run together get one
//! claim each (their own quota, as the extended resource gave them), shapes share
//! templates, never claims. A dry run is patched and writes nothing (`sideEffects:
//! NoneOnDryRun`).
//!
//! # When the webhook is down
//!
//! The configuration sends the webhook only pods' creations that ask for the resource: a CEL
//! `matchCondition` (GA since 1.30; DRA needs 1.34) on `vramguard.io/gpu-memory` in any
//! container's or init container's limits or requests. Those are `failurePolicy: Fail`: a
//! pod that asks for a quota is refused while no replica answers (its creator retries: a
//! ReplicaSet does, with backoff), rather than admitted with the node-wide extended resource
//! that, under `--dra`, no node advertises any more (it would stay Pending, or on a node still
//! advertising it, get a quota the scheduler did not place). Every other pod never reaches
//! the webhook, so nothing else in the cluster, the webhook's own pods included, can be
//! blocked by it. Two replicas, a PodDisruptionBudget and a `timeoutSeconds` of 10 keep
//! the window small.
//!
//! # Trust
//!
//! The API server is trusted (it authenticates the webhook by TLS: the webhook serves the
//! certificate the configuration's `caBundle` verifies); the webhook cannot authenticate its
//! caller (the API server presents no client certificate unless configured to), so a review's
//! body is decoded with bounds (size, time) and every field checked, since anything that
//! reaches the Service can post one. A forged review gets the patch of a pod that is never
//! created, and makes the webhook create a template per shape in the namespace it names: the
//! creations are capped ([`templates::CREATIONS_PER_MINUTE`]) so that such a client cannot
//! fill etcd quickly; a NetworkPolicy admitting only the control plane to the webhook's port
//! (its addresses are the cluster's own) closes the Service to others.
pub mod metrics;
pub mod mutate;
pub mod pki;
pub mod review;
pub mod secret;
pub mod server;
pub mod templates;
pub mod tls;

use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use anyhow::{Context, Result};
use tokio::signal::unix::{signal, SignalKind};
use tracing::info;

use crate::{
    dra::DRIVER,
    provision::kube::ApiArgs,
    serve::http::{self as serve_http, Connections, Site},
};

/// How long one API call for a template may take (a review makes up to three per shape, within
/// the API server's `timeoutSeconds: 10`).
const API_DEADLINE: Duration = Duration::from_secs(3);

/// The flags of `vramguard webhook`.
#[derive(clap::Args, Clone, Debug)]
pub struct WebhookArgs {
    /// Where to serve admission reviews over HTTPS (`POST /mutate`).
    #[arg(long, default_value = "0.0.0.0:8443", value_name = "ADDR")]
    pub listen: SocketAddr,
    /// The PEM certificate chain served (the Secret's `tls.crt`), re-read when it changes
    /// (without `--manage-certificate`).
    #[arg(long, default_value = "/etc/vramguard/webhook-tls/tls.crt", value_name = "PATH")]
    pub tls_cert: PathBuf,
    /// The PEM private key of the certificate (the Secret's `tls.key`).
    #[arg(long, default_value = "/etc/vramguard/webhook-tls/tls.key", value_name = "PATH")]
    pub tls_key: PathBuf,
    /// Where to serve `/metrics`, `/healthz` and `/readyz` over plain HTTP.
    #[arg(long, default_value = "0.0.0.0:9400", value_name = "ADDR")]
    pub metrics_addr: SocketAddr,
    /// Make the CA and serving pair, keep them in `--tls-secret` (created, renewed before their
    /// end, repaired) and write the CA into `--webhook-configuration`'s caBundle, instead of
    /// reading `--tls-cert` and `--tls-key` (cert-manager's, or a Secret of your own).
    #[arg(long)]
    pub manage_certificate: bool,
    /// With `--manage-certificate`: the Secret that holds the CA and the pair.
    #[arg(long, default_value = "vramguard-system/vramguard-webhook-tls", value_name = "NAMESPACE/NAME")]
    pub tls_secret: String,
    /// With `--manage-certificate`: the Service the API server calls, in the Secret's namespace
    /// (its DNS names are the certificate's).
    #[arg(long, default_value = "vramguard-webhook", value_name = "NAME")]
    pub service: String,
    /// With `--manage-certificate`: the MutatingWebhookConfiguration whose webhooks' caBundle
    /// is the Secret's CA.
    #[arg(long, default_value = "vramguard-webhook", value_name = "NAME")]
    pub webhook_configuration: String,
    /// How often the Secret is checked (seconds).
    #[arg(long, default_value_t = 60, value_name = "SECONDS", hide = true)]
    pub certificate_check_every: u64,
    /// The serving certificate's life and how long before its end it is renewed (seconds).
    #[arg(long, default_value_t = pki::Lifetimes::default().serving.as_secs(), value_name = "SECONDS", hide = true)]
    pub certificate_validity: u64,
    #[arg(long, default_value_t = pki::Lifetimes::default().serving_renew_before.as_secs(), value_name = "SECONDS", hide = true)]
    pub certificate_renew_before: u64,
    /// The CA's life and how long before its end it is replaced (seconds).
    #[arg(long, default_value_t = pki::Lifetimes::default().ca.as_secs(), value_name = "SECONDS", hide = true)]
    pub ca_validity: u64,
    #[arg(long, default_value_t = pki::Lifetimes::default().ca_renew_before.as_secs(), value_name = "SECONDS", hide = true)]
    pub ca_renew_before: u64,
    /// The DeviceClass the templates' requests name.
    #[arg(long, default_value = DRIVER, value_name = "NAME")]
    pub device_class: String,
    /// How to reach the API server (the agent's flags, without `--kube`).
    #[command(flatten)]
    pub api: ApiArgs,
}

/// Serves admission reviews until SIGTERM or SIGINT.
pub async fn run(args: WebhookArgs) -> Result<()> {
    let client = args.api.config().await?.client()?;
    let registry = prometheus::Registry::new();
    let metrics = metrics::WebhookMetrics::new(&registry)?;
    let (certificates, managed) = if args.manage_certificate {
        let (namespace, secret) = secret::parse_secret(&args.tls_secret)?;
        let place = secret::Place { namespace, secret, service: args.service.clone(), configuration: args.webhook_configuration.clone() };
        let lifetimes = pki::Lifetimes {
            ca: Duration::from_secs(args.ca_validity),
            ca_renew_before: Duration::from_secs(args.ca_renew_before),
            serving: Duration::from_secs(args.certificate_validity),
            serving_renew_before: Duration::from_secs(args.certificate_renew_before),
        };
        lifetimes.check()?;
        let managed = secret::Managed::new(client.clone(), place, lifetimes, API_DEADLINE, metrics.clone());
        (managed.start().await?, Some(managed))
    } else {
        (tls::Certificates::load(&args.tls_cert, &args.tls_key)?, None)
    };
    let acceptor = tokio_rustls::TlsAcceptor::from(certificates.server_config()?);
    let store = Arc::new(templates::Templates::new(client, args.device_class.clone(), API_DEADLINE));
    let connections = Connections::named("vramguard_webhook_metrics_connections_total", "Connections to the webhook's --metrics-addr by how they ended")?;
    registry.register(connections.collector())?;
    let (metrics_addr, metrics_site) = serve_http::serve_site(args.metrics_addr, serve_http::LIMITS, Site::Registry(registry), connections).await?;
    let (webhook_addr, reviews) = server::serve(args.listen, server::LIMITS, acceptor, store, metrics.clone()).await?;
    info!(%webhook_addr, %metrics_addr, device_class = %args.device_class, "serving admission reviews on {webhook_addr}{}", server::MUTATE);
    let mut terminate = signal(SignalKind::terminate()).context("SIGTERM handler")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("SIGINT handler")?;
    tokio::select! {
        () = reviews => anyhow::bail!("the webhook's listener ended"),
        () = metrics_site => anyhow::bail!("the metrics listener ended"),
        () = keep(certificates, managed, metrics, Duration::from_secs(args.certificate_check_every.max(1))) => anyhow::bail!("the certificate watch ended"),
        _ = terminate.recv() => info!("SIGTERM: stopping"),
        _ = interrupt.recv() => info!("SIGINT: stopping"),
    }
    Ok(())
}

/// Keeps the served pair current: the Secret's (`managed`) or the files'.
async fn keep(certificates: Arc<tls::Certificates>, managed: Option<secret::Managed>, metrics: metrics::WebhookMetrics, every: Duration) {
    match managed {
        Some(managed) => managed.keep(certificates, every).await,
        None => certificates.watch(metrics).await,
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        webhook: WebhookArgs,
    }

    #[test]
    fn flags() {
        let cli = Cli::try_parse_from(["x"]).expect("defaults");
        assert_eq!(cli.webhook.listen, "0.0.0.0:8443".parse::<SocketAddr>().expect("addr"));
        assert_eq!(cli.webhook.device_class, "gpu.vramguard.io");
        assert_eq!(cli.webhook.tls_cert, PathBuf::from("/etc/vramguard/webhook-tls/tls.crt"));
        assert!(Cli::try_parse_from(["x", "--kube-token-file", "t"]).is_err(), "a token file needs --kube-api");
        assert!(Cli::try_parse_from(["x", "--kube-api", "https://a", "--kubeconfig", "k"]).is_err());
        let explicit = Cli::try_parse_from(["x", "--kube-api", "https://10.0.0.1:6443", "--kube-ca-file", "ca.crt", "--listen", "127.0.0.1:0"]).expect("flags");
        assert_eq!(explicit.webhook.api.kube_api.as_deref(), Some("https://10.0.0.1:6443"));
        assert!(Cli::try_parse_from(["x", "--kubeconfig", "k"]).is_ok(), "no --kube here");
        assert!(!cli.webhook.manage_certificate);
        assert_eq!(cli.webhook.tls_secret, "vramguard-system/vramguard-webhook-tls");
        assert_eq!(cli.webhook.certificate_renew_before, 30 * 86_400);
        let managed = Cli::try_parse_from(["x", "--manage-certificate", "--tls-secret", "ns/s", "--service", "svc", "--webhook-configuration", "c", "--certificate-validity", "20"]).expect("managed");
        assert!(managed.webhook.manage_certificate);
        assert_eq!((managed.webhook.service.as_str(), managed.webhook.webhook_configuration.as_str(), managed.webhook.certificate_validity), ("svc", "c", 20));
    }
}
