//! The HTTP side of the API client: one HTTP/1.1 connection per request (TLS with the
//! configured CA, or plain http to loopback), the bearer token on every request, bounded
//! answer sizes, and the API's `Status` objects turned into [`KubeError::Status`]. Watches
//! come back as a [`Lines`] stream of newline-delimited JSON.
use std::{pin::Pin, sync::Arc, time::Duration};

use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use hyper::{
    body::Incoming,
    client::conn::http1,
    header::{HeaderValue, ACCEPT, AUTHORIZATION, CONTENT_TYPE, HOST, USER_AGENT},
    Method, Request, Response, StatusCode,
};
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use serde::de::DeserializeOwned;
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::TcpStream,
};
use tracing::debug;

use super::{
    config::{Endpoint, Token},
    objects::Status,
    KubeConfig, KubeError,
};

/// The most bytes of one answer (a list of the pods on a node is well under this).
pub(crate) const MAX_BODY_BYTES: usize = 64 << 20;
/// The most bytes of one watch event (one object).
pub(crate) const MAX_EVENT_BYTES: usize = 8 << 20;
/// How long a request that is not a watch may take, connection included.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// A client of one API server. Cheap to clone.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("endpoint", &self.inner.endpoint).finish_non_exhaustive()
    }
}

struct Inner {
    endpoint: Endpoint,
    tls: Option<(tokio_rustls::TlsConnector, ServerName<'static>)>,
    token: Option<Token>,
}

trait Io: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}

impl Client {
    /// A client for `config` (reads its CA file now; the token is read at the first request).
    pub fn new(config: &KubeConfig) -> Result<Client, KubeError> {
        let tls = config.tls()?.map(|(config, name)| (tokio_rustls::TlsConnector::from(config), name));
        let token = config.token_file.clone().map(Token::new);
        Ok(Client { inner: Arc::new(Inner { endpoint: config.endpoint.clone(), tls, token }) })
    }

    /// `GET path` decoded as `T`.
    pub(crate) async fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T, KubeError> {
        let what = format!("GET {path}");
        let response = self.send(Method::GET, path, None).await?;
        let body = collect(response.into_body(), MAX_BODY_BYTES, &what).await?;
        serde_json::from_slice(&body).map_err(|e| KubeError::Decode { what, reason: e.to_string() })
    }

    /// `PATCH path` with `body` of `content_type`; the answer is read and dropped.
    pub(crate) async fn patch(&self, path: &str, content_type: &'static str, body: Vec<u8>) -> Result<(), KubeError> {
        let what = format!("PATCH {path}");
        let response = self.send(Method::PATCH, path, Some((content_type, body))).await?;
        collect(response.into_body(), MAX_BODY_BYTES, &what).await.map(drop)
    }

    /// `GET path` of a watch: its events, one JSON object a line, as they come.
    pub(crate) async fn watch(&self, path: &str) -> Result<Lines, KubeError> {
        let response = self.send(Method::GET, path, None).await?;
        Ok(Lines { body: response.into_body(), buffer: BytesMut::new(), what: format!("watch {path}") })
    }

    /// Sends one request, retrying once with a re-read token if the server answers 401;
    /// answers other than 2xx become [`KubeError::Status`].
    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<(&'static str, Vec<u8>)>,
    ) -> Result<Response<Incoming>, KubeError> {
        let mut reread = false;
        loop {
            let response = self.send_once(method.clone(), path, body.clone(), reread).await?;
            let status = response.status();
            if status.is_success() {
                return Ok(response);
            }
            if status == StatusCode::UNAUTHORIZED && !reread && self.inner.token.is_some() {
                debug!("kube: {method} {path}: 401, reading the token again");
                reread = true;
                continue;
            }
            let what = format!("{method} {path}");
            let body = collect(response.into_body(), 64 * 1024, &what).await.unwrap_or_default();
            let message = serde_json::from_slice::<Status>(&body)
                .ok()
                .map(|s| if s.reason.is_empty() { s.message } else { format!("{}: {}", s.reason, s.message) })
                .unwrap_or_else(|| String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned());
            return Err(KubeError::Status { code: status.as_u16(), what, message });
        }
    }

    async fn send_once(
        &self,
        method: Method,
        path: &str,
        body: Option<(&'static str, Vec<u8>)>,
        reread: bool,
    ) -> Result<Response<Incoming>, KubeError> {
        let inner = &self.inner;
        let endpoint = &inner.endpoint;
        let mut request = Request::builder()
            .method(method)
            .uri(path)
            .header(HOST, &endpoint.authority)
            .header(ACCEPT, "application/json")
            .header(USER_AGENT, concat!("vramguard/", env!("CARGO_PKG_VERSION")));
        if let Some(token) = &inner.token {
            request = request.header(AUTHORIZATION, token.header(reread)?);
        }
        let body = match body {
            Some((content_type, bytes)) => {
                request = request.header(CONTENT_TYPE, HeaderValue::from_static(content_type));
                Full::new(Bytes::from(bytes))
            }
            None => Full::new(Bytes::new()),
        };
        let request = request
            .body(body)
            .map_err(|e| KubeError::Config(format!("request {path:?} cannot be built: {e}")))?;

        let addr = (endpoint.host.as_str(), endpoint.port);
        let connect_err = |source| KubeError::Connect { addr: endpoint.authority.clone(), source };
        let tcp = TcpStream::connect(addr).await.map_err(connect_err)?;
        tcp.set_nodelay(true).map_err(connect_err)?;
        let io: Pin<Box<dyn Io>> = match &inner.tls {
            Some((connector, name)) => {
                Box::pin(connector.connect(name.clone(), tcp).await.map_err(|source| KubeError::Tls {
                    addr: endpoint.authority.clone(),
                    source,
                })?)
            }
            None => Box::pin(tcp),
        };
        let (mut sender, connection) = http1::handshake(TokioIo::new(io)).await?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                debug!("kube: connection to the API server ended: {e}");
            }
        });
        Ok(sender.send_request(request).await?)
    }
}

/// Reads a whole answer, refusing one past `limit` bytes.
async fn collect(mut body: Incoming, limit: usize, what: &str) -> Result<Bytes, KubeError> {
    let mut bytes = BytesMut::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame?.into_data() {
            if bytes.len() + data.len() > limit {
                return Err(KubeError::Decode { what: what.to_owned(), reason: format!("the answer is larger than {limit} bytes") });
            }
            bytes.extend_from_slice(&data);
        }
    }
    Ok(bytes.freeze())
}

/// The lines of a watch's answer.
pub(crate) struct Lines {
    body: Incoming,
    buffer: BytesMut,
    what: String,
}

impl Lines {
    /// The next non-empty line, `None` when the server ended the watch.
    pub(crate) async fn next(&mut self) -> Result<Option<Bytes>, KubeError> {
        loop {
            if let Some(end) = self.buffer.iter().position(|&b| b == b'\n') {
                let line = self.buffer.split_to(end + 1).freeze();
                let line = line.slice(..end);
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                return Ok(Some(line));
            }
            if self.buffer.len() > MAX_EVENT_BYTES {
                return Err(KubeError::Decode {
                    what: self.what.clone(),
                    reason: format!("an event is larger than {MAX_EVENT_BYTES} bytes"),
                });
            }
            match self.body.frame().await {
                Some(frame) => {
                    if let Ok(data) = frame?.into_data() {
                        self.buffer.extend_from_slice(&data);
                    }
                }
                None if self.buffer.iter().all(u8::is_ascii_whitespace) => return Ok(None),
                // The last event without its newline.
                None => return Ok(Some(std::mem::take(&mut self.buffer).freeze())),
            }
        }
    }
}
