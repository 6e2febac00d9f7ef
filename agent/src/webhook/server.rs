//! The webhook's HTTPS listener (`--listen`): TLS by rustls ([`super::tls`]), hyper's HTTP/1
//! server, one request per connection, `POST /mutate` only ([`super::review`]).
//!
//! Every API server of the cluster may call it, and anything that reaches the Service can,
//! so a client gets bounded work ([`Limits`]): connections open at once (the agent's
//! [`Gate`]: the oldest connection that has not sent its request makes room, and when every
//! one is being answered the newcomer is closed), the time from accepting the connection to
//! the end of the answer (TLS handshake, head, body, the template calls, the answer), the
//! head's size and fields, the body's bytes (`413` past them). Other paths get `404`, other
//! methods `405`, a body that is not JSON `415`. Each connection's end is counted in
//! `vramguard_webhook_connections_total{outcome}`.
use std::{convert::Infallible, net::SocketAddr, sync::Arc, time::Duration};

use anyhow::{Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::{
    body::Incoming,
    header::{HeaderValue, ALLOW, CONTENT_TYPE},
    server::conn::http1,
    service::service_fn,
    Method, Request, Response, StatusCode,
};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tracing::debug;

use super::{
    metrics::WebhookMetrics,
    review::{self, TemplateStore},
};
use crate::serve::{
    gate::{Admission, Gate},
    http,
};

/// The path the MutatingWebhookConfiguration names.
pub const MUTATE: &str = "/mutate";

/// What the listener allows a client: the metrics listener's limits on connections, heads
/// and time ([`http::Limits`]; `deadline` runs from the accept, the TLS handshake included),
/// and the body's bytes.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub connection: http::Limits,
    /// The largest body: a review carries one pod (at most about 1.5 MiB in etcd).
    pub body_bytes: usize,
}

/// The production limits: the API servers' calls (timeoutSeconds 10 in the configuration),
/// a pod of the largest size etcd stores.
pub const LIMITS: Limits = Limits {
    connection: http::Limits {
        connections: 256,
        header_timeout: Duration::from_secs(5),
        deadline: Duration::from_secs(12),
        head_bytes: 16 * 1024,
        headers: 64,
    },
    body_bytes: 4 << 20,
};

/// Binds `addr`; the returned task serves reviews over TLS from `acceptor`.
pub async fn serve<S: TemplateStore + Send + 'static>(
    addr: SocketAddr,
    limits: Limits,
    acceptor: TlsAcceptor,
    store: Arc<S>,
    metrics: WebhookMetrics,
) -> Result<(SocketAddr, impl std::future::Future<Output = ()> + Send + 'static)> {
    let listener = TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr} for admission reviews"))?;
    let bound = listener.local_addr().context("the webhook's listener has no address")?;
    Ok((bound, accept(listener, limits, acceptor, store, metrics)))
}

async fn accept<S: TemplateStore + Send + 'static>(listener: TcpListener, limits: Limits, acceptor: TlsAcceptor, store: Arc<S>, metrics: WebhookMetrics) {
    let gate = Gate::new(limits.connection.connections);
    let builder = limits.connection.builder();
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                debug!(%error, "webhook accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        match gate.admit().await {
            Admission::Refused => {
                drop(stream);
                metrics.connection("refused");
            }
            Admission::Admitted { ticket, evicted, made_room } => {
                if made_room {
                    metrics.connection("evicted");
                }
                let connection = Connection { acceptor: acceptor.clone(), store: store.clone(), metrics: metrics.clone(), limits };
                let (metrics, builder) = (metrics.clone(), builder.clone());
                tokio::spawn(async move {
                    tokio::select! {
                        ended = tokio::time::timeout(limits.connection.deadline, connection.run(stream, peer, builder, ticket)) => {
                            if ended.is_err() {
                                metrics.connection("timed_out");
                            }
                        }
                        // Counted as evicted when the newcomer was admitted.
                        Ok(()) = evicted => {}
                    }
                });
            }
        }
    }
}

struct Connection<S> {
    acceptor: TlsAcceptor,
    store: Arc<S>,
    metrics: WebhookMetrics,
    limits: Limits,
}

impl<S: TemplateStore + Send + 'static> Connection<S> {
    /// Serves the connection; its outcome's label.
    async fn run(self, stream: TcpStream, peer: SocketAddr, builder: http1::Builder, ticket: Arc<crate::serve::gate::Ticket>) -> &'static str {
        let metrics = self.metrics.clone();
        let outcome = self.serve(stream, peer, builder, ticket).await;
        metrics.connection(outcome);
        outcome
    }

    async fn serve(self, stream: TcpStream, peer: SocketAddr, builder: http1::Builder, ticket: Arc<crate::serve::gate::Ticket>) -> &'static str {
        let tls = match self.acceptor.accept(stream).await {
            Ok(tls) => tls,
            Err(error) => {
                debug!(%peer, %error, "webhook TLS handshake failed");
                return "tls_failed";
            }
        };
        let (store, metrics, limits) = (self.store, self.metrics, self.limits);
        let arrived = ticket.clone();
        let service = service_fn(move |request: Request<Incoming>| {
            arrived.arrived();
            let (store, metrics) = (store.clone(), metrics.clone());
            async move { Ok::<_, Infallible>(respond(request, &*store, &metrics, limits.body_bytes).await) }
        });
        match builder.serve_connection(TokioIo::new(tls), service).await {
            Ok(()) if ticket.has_arrived() => "answered",
            Ok(()) => "closed",
            Err(error) if error.is_timeout() => "timed_out",
            Err(error) if error.is_parse() || error.is_parse_too_large() => "bad_request",
            Err(error) => {
                debug!(%peer, %error, "webhook client");
                "error"
            }
        }
    }
}

/// The answer to one request.
async fn respond(request: Request<Incoming>, store: &impl TemplateStore, metrics: &WebhookMetrics, body_bytes: usize) -> Response<Full<Bytes>> {
    if request.uri().path() != MUTATE {
        return text(StatusCode::NOT_FOUND, "not found: reviews go to /mutate\n");
    }
    if request.method() != Method::POST {
        let mut response = text(StatusCode::METHOD_NOT_ALLOWED, "only POST\n");
        response.headers_mut().insert(ALLOW, HeaderValue::from_static("POST"));
        return response;
    }
    let json = request.headers().get(CONTENT_TYPE).is_none_or(|t| t.to_str().is_ok_and(|t| t.starts_with("application/json")));
    if !json {
        metrics.review("bad_request", 0.0);
        return text(StatusCode::UNSUPPORTED_MEDIA_TYPE, "an AdmissionReview is application/json\n");
    }
    let body = match Limited::new(request.into_body(), body_bytes).collect().await {
        Ok(body) => body.to_bytes(),
        Err(error) if error.is::<http_body_util::LengthLimitError>() => {
            metrics.review("bad_request", 0.0);
            return text(StatusCode::PAYLOAD_TOO_LARGE, format!("a review is at most {body_bytes} bytes\n"));
        }
        Err(error) => return text(StatusCode::BAD_REQUEST, format!("reading the body: {error}\n")),
    };
    let answer = review::answer(&body, store, metrics).await;
    let mut response = Response::new(Full::new(Bytes::from(answer.body.to_string())));
    *response.status_mut() = answer.status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

fn text(status: StatusCode, body: impl Into<String>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body.into())));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    response
}
