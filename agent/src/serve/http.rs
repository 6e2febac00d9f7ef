//! The HTTP listener of `--metrics-addr`: hyper's HTTP/1 server, one request per connection,
//! answering `GET`/`HEAD` of `/metrics`, `/healthz` and `/readyz` from the [`Board`]. A request
//! never runs a pass and never reads a ledger: it is served the last rendered page (a copy of
//! a reference), after asking the event loop for a page of its last pass if the page is
//! older (at most [`RENDER_WAIT`]; the loop renders at most once per pass).
//!
//! It is the root agent's only network surface, so everything a client sends is bounded
//! ([`Limits`]; [`LIMITS`] in production): connections open at once ([`Gate`]: past the cap
//! the oldest connection that has not sent its request yet makes room, and when every one is
//! being answered the newcomer is closed at once), the time to send the request head, the
//! connection's whole life, the head's size and its number of fields (hyper answers `431`
//! beyond them); bodies are refused (`413`), other methods `405`, other paths `404`. Every
//! connection's outcome is counted in `vramguard_http_connections_total{outcome}`.
use std::{
    future::Future,
    convert::Infallible,
    net::SocketAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use bytes::Bytes;
use http_body_util::Full;
use hyper::{
    body::Incoming,
    header::{HeaderValue, ALLOW, CONTENT_LENGTH, CONTENT_TYPE, TRANSFER_ENCODING},
    server::conn::http1,
    service::service_fn,
    HeaderMap, Method, Request, Response, StatusCode,
};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus::{core::Collector, IntCounterVec, Opts};
use tokio::{
    net::{TcpListener, TcpStream},
    sync::oneshot,
};
use tracing::{debug, warn};

use super::{
    gate::{Admission, Gate, Ticket},
    health::Health,
    Board, Progress, Published,
};

/// What the listener allows a client.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connections open at once.
    pub connections: usize,
    /// How long a client may take to send its request head.
    pub header_timeout: Duration,
    /// How long a connection may last in all, the answer's sending included.
    pub deadline: Duration,
    /// The largest request head (request line and header fields), in bytes.
    pub head_bytes: usize,
    /// The most header fields a request may carry.
    pub headers: usize,
}

impl Limits {
    /// hyper's HTTP/1 server with these limits on the head, one request per connection.
    pub fn builder(&self) -> http1::Builder {
        let mut builder = http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(self.header_timeout)
            .max_header_size(self.head_bytes)
            .max_headers(self.headers)
            .max_buf_size(self.head_bytes.max(MIN_BUFFER))
            .keep_alive(false);
        builder
    }
}

/// The production limits: a Prometheus server or two and the kubelet's probes need a handful
/// of connections, a few header fields and well under a second each.
pub const LIMITS: Limits = Limits {
    connections: 64,
    header_timeout: Duration::from_secs(5),
    deadline: Duration::from_secs(10),
    head_bytes: 8192,
    headers: 32,
};

/// How long the published state may go without a new pass before `/healthz` reports the
/// event loop stuck (a pass runs at least every second).
pub const STALE_AFTER: Duration = Duration::from_secs(30);

/// How long a scrape waits for the event loop to render the page of its last pass before it
/// takes the page there is.
pub const RENDER_WAIT: Duration = Duration::from_secs(2);

/// hyper's smallest read buffer.
const MIN_BUFFER: usize = 8192;

/// How often the listener says, at most, that it is at its cap.
const CAP_WARNING_EVERY: Duration = Duration::from_secs(60);

/// How a connection ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    /// Its request was answered.
    Answered,
    /// The client closed it without sending a request.
    Closed,
    /// Past the cap with every connection being answered: closed at once.
    Refused,
    /// Past the cap: closed, before its request arrived, to make room for a newer one.
    Evicted,
    /// Its request head or the whole connection took too long.
    TimedOut,
    /// A request hyper could not parse or that exceeded the head limits (hyper answered 4xx).
    BadRequest,
    /// An I/O error (e.g. reset by the client).
    Error,
}

impl Outcome {
    const ALL: [Outcome; 7] = [
        Outcome::Answered,
        Outcome::Closed,
        Outcome::Refused,
        Outcome::Evicted,
        Outcome::TimedOut,
        Outcome::BadRequest,
        Outcome::Error,
    ];

    fn name(self) -> &'static str {
        match self {
            Outcome::Answered => "answered",
            Outcome::Closed => "closed",
            Outcome::Refused => "refused",
            Outcome::Evicted => "evicted",
            Outcome::TimedOut => "timed_out",
            Outcome::BadRequest => "bad_request",
            Outcome::Error => "error",
        }
    }
}

/// `vramguard_http_connections_total{outcome}`: the listener's connections by how they ended.
#[derive(Clone)]
pub struct Connections(IntCounterVec);

impl Connections {
    /// `vramguard_http_connections_total`, of the metrics listener.
    pub fn new() -> Result<Connections> {
        Connections::named(
            "vramguard_http_connections_total",
            "Connections to --metrics-addr by how they ended: answered, closed, refused (past the cap), evicted (idle past the cap), timed_out, bad_request, error",
        )
    }

    /// The same family under another name (the health listener's).
    pub fn named(name: &str, help: &str) -> Result<Connections> {
        let counter = IntCounterVec::new(Opts::new(name, help), &["outcome"])?;
        for outcome in Outcome::ALL {
            counter.with_label_values(&[outcome.name()]);
        }
        Ok(Connections(counter))
    }

    /// The family, for the agent's registry.
    pub fn collector(&self) -> Box<dyn Collector> {
        Box::new(self.0.clone())
    }

    fn count(&self, outcome: Outcome) {
        self.0.with_label_values(&[outcome.name()]).inc();
    }

    #[cfg(test)]
    fn get(&self, outcome: Outcome) -> u64 {
        self.0.with_label_values(&[outcome.name()]).get()
    }
}

/// What a listener serves: the metrics page (with `/healthz` and `/readyz` as the event loop's
/// progress says them), or health alone ([`super::health`]).
#[derive(Clone)]
pub enum Site {
    Metrics(Board),
    Health(Health),
    /// A registry rendered at each scrape of `/metrics`, `/healthz` and `/readyz` answered
    /// while the process serves (`vramguard webhook`: no tasks to watch, nothing to render
    /// ahead).
    Registry(prometheus::Registry),
}

impl Site {
    fn name(&self) -> &'static str {
        match self {
            Site::Metrics(_) | Site::Registry(_) => "metrics",
            Site::Health(_) => "health",
        }
    }
}

/// Binds `addr`; the returned task serves it from what `board` holds at each request.
pub async fn serve(addr: SocketAddr, limits: Limits, board: Board, connections: Connections) -> Result<(SocketAddr, impl Future<Output = ()> + Send + 'static)> {
    serve_site(addr, limits, Site::Metrics(board), connections).await
}

/// Binds `addr`; the returned task (for the agent's supervisor to run) serves `site`.
pub async fn serve_site(addr: SocketAddr, limits: Limits, site: Site, connections: Connections) -> Result<(SocketAddr, impl Future<Output = ()> + Send + 'static)> {
    let name = site.name();
    let listener = TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr} for {name}"))?;
    let bound = listener.local_addr().with_context(|| format!("the {name} listener has no address"))?;
    Ok((bound, accept(listener, limits, site, connections)))
}

async fn accept(listener: TcpListener, limits: Limits, board: Site, connections: Connections) {
    let gate = Gate::new(limits.connections);
    let builder = limits.builder();
    let mut warned: Option<Instant> = None;
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                // E.g. out of file descriptors: let some connections end first.
                debug!(%error, "metrics accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let at_cap = match gate.admit().await {
            Admission::Refused => {
                drop(stream);
                connections.count(Outcome::Refused);
                debug!(%peer, "metrics connection refused: every connection is being answered");
                true
            }
            Admission::Admitted { ticket, evicted, made_room } => {
                let connection = Connection { ticket, evicted, board: board.clone(), connections: connections.clone() };
                tokio::spawn(connection.run(stream, peer, builder.clone(), limits.deadline));
                made_room
            }
        };
        if at_cap && warned.is_none_or(|at| at.elapsed() >= CAP_WARNING_EVERY) {
            warned = Some(Instant::now());
            warn!(
                cap = limits.connections,
                "the metrics listener is at its connection cap: evicting idle connections and refusing new ones (counted in vramguard_http_connections_total)"
            );
        }
    }
}

/// One admitted connection.
struct Connection {
    ticket: Arc<Ticket>,
    evicted: oneshot::Receiver<()>,
    board: Site,
    connections: Connections,
}

impl Connection {
    async fn run(mut self, stream: TcpStream, peer: SocketAddr, builder: http1::Builder, deadline: Duration) {
        let ticket = self.ticket.clone();
        let board = self.board;
        let service = service_fn(move |request: Request<Incoming>| {
            ticket.arrived();
            let board = board.clone();
            async move { Ok::<_, Infallible>(answer(&request, &board).await) }
        });
        let serving = builder.serve_connection(TokioIo::new(stream), service);
        let outcome = tokio::select! {
            served = tokio::time::timeout(deadline, serving) => match served {
                Err(_) => Outcome::TimedOut,
                Ok(Ok(())) if self.ticket.has_arrived() => Outcome::Answered,
                Ok(Ok(())) => Outcome::Closed,
                Ok(Err(error)) if error.is_timeout() => Outcome::TimedOut,
                Ok(Err(error)) if error.is_parse() || error.is_parse_too_large() => Outcome::BadRequest,
                Ok(Err(error)) => {
                    debug!(%peer, %error, "metrics client");
                    Outcome::Error
                }
            },
            // The sender goes away unused once the request has arrived: then only the
            // branch above is left.
            Ok(()) = &mut self.evicted => Outcome::Evicted,
        };
        self.connections.count(outcome);
    }
}

/// The answer to `request`: from `site`.
async fn answer<B>(request: &Request<B>, site: &Site) -> Response<Full<Bytes>> {
    match site {
        Site::Metrics(board) => answer_metrics(request, board).await,
        Site::Health(health) => match refuse(request, &["/healthz", "/readyz"]) {
            Some(refusal) => refusal,
            None => health.answer(request.uri().path()),
        },
        Site::Registry(registry) => match refuse(request, &["/metrics", "/healthz", "/readyz"]) {
            Some(refusal) => refusal,
            None => match request.uri().path() {
                "/metrics" => {
                    let mut body = Vec::new();
                    match prometheus::Encoder::encode(&prometheus::TextEncoder::new(), &registry.gather(), &mut body) {
                        Ok(()) => page(StatusCode::OK, prometheus::TEXT_FORMAT, Bytes::from(body)),
                        Err(error) => text(StatusCode::INTERNAL_SERVER_ERROR, format!("cannot encode the metrics: {error}\n")),
                    }
                }
                "/healthz" => text(StatusCode::OK, "ok\n"),
                _ => text(StatusCode::OK, "ready\n"),
            },
        },
    }
}

/// The answer to `request`: for `/metrics`, the page of the loop's last pass if the loop
/// renders it within [`RENDER_WAIT`], else the page there is.
async fn answer_metrics<B>(request: &Request<B>, board: &Board) -> Response<Full<Bytes>> {
    let mut pages = board.pages.clone();
    let behind = pages.borrow_and_update().passes < board.progress.borrow().passes;
    if behind && request.uri().path() == "/metrics" {
        board.wanted.notify_one();
        let _ = tokio::time::timeout(RENDER_WAIT, pages.changed()).await;
    }
    let mut page = pages.borrow().clone();
    if let (Some(liveness), Ok(body)) = (board.liveness.as_ref(), page.metrics.as_ref()) {
        page.metrics = super::health::exposition(liveness)
            .map(|tasks| Bytes::from([body.as_ref(), tasks.as_slice()].concat()))
            .map_err(|error| error.to_string());
    }
    let progress = *board.progress.borrow();
    respond(request, &page, &progress, Instant::now())
}

/// The answer to `request` from `published` and the loop's `progress`.
fn respond<B>(request: &Request<B>, published: &Published, progress: &Progress, now: Instant) -> Response<Full<Bytes>> {
    if let Some(refusal) = refuse(request, &["/metrics", "/healthz", "/readyz"]) {
        return refusal;
    }
    match request.uri().path() {
        "/metrics" => match &published.metrics {
            Ok(body) => page(StatusCode::OK, prometheus::TEXT_FORMAT, body.clone()),
            Err(error) => text(StatusCode::INTERNAL_SERVER_ERROR, format!("cannot encode the metrics: {error}\n")),
        },
        "/healthz" => {
            let age = now.saturating_duration_since(progress.at);
            if age > STALE_AFTER {
                text(StatusCode::SERVICE_UNAVAILABLE, format!("no reconcile pass for {} s\n", age.as_secs()))
            } else {
                text(StatusCode::OK, "ok\n")
            }
        }
        _ => match published.not_ready {
            Some(reason) => text(StatusCode::SERVICE_UNAVAILABLE, format!("{reason}\n")),
            None => text(StatusCode::OK, "ready\n"),
        },
    }
}

/// The refusal of a request for a path not in `paths`, of a method other than `GET` and
/// `HEAD`, or with a body; `None` for a request to answer.
fn refuse<B>(request: &Request<B>, paths: &[&str]) -> Option<Response<Full<Bytes>>> {
    if !paths.contains(&request.uri().path()) {
        return Some(text(StatusCode::NOT_FOUND, "not found\n"));
    }
    if request.method() != Method::GET && request.method() != Method::HEAD {
        let mut response = text(StatusCode::METHOD_NOT_ALLOWED, "only GET and HEAD\n");
        response.headers_mut().insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return Some(response);
    }
    if carries_body(request.headers()) {
        return Some(text(StatusCode::PAYLOAD_TOO_LARGE, "requests with a body are refused\n"));
    }
    None
}

/// Whether a request says it carries a body.
fn carries_body(headers: &HeaderMap) -> bool {
    headers.contains_key(TRANSFER_ENCODING) || headers.get(CONTENT_LENGTH).is_some_and(|length| length.as_bytes() != b"0")
}

pub(super) fn text(status: StatusCode, body: impl Into<String>) -> Response<Full<Bytes>> {
    page(status, "text/plain; charset=utf-8", Bytes::from(body.into()))
}

fn page(status: StatusCode, content_type: &'static str, body: Bytes) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

#[cfg(test)]
mod tests {
    use std::io::ErrorKind;

    use http_body_util::BodyExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::serve::Publisher;
    use tokio::sync::Notify;

    fn published(metrics: &str) -> Published {
        Published { metrics: Ok(Bytes::from(metrics.to_string())), not_ready: None, passes: 0 }
    }

    fn progress() -> Progress {
        Progress { passes: 0, at: Instant::now() }
    }

    fn request(method: Method, uri: &str, headers: &[(&'static str, &'static str)]) -> Request<()> {
        let mut request = Request::builder().method(method).uri(uri);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        request.body(()).expect("request")
    }

    async fn answer_of(request: &Request<()>, published: &Published, now: Instant) -> (StatusCode, String) {
        let response = respond(request, published, &Progress { at: now, ..progress() }, now);
        let status = response.status();
        let body = response.into_body().collect().await.expect("body").to_bytes();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test]
    async fn routes_get_and_head_of_three_paths() {
        let state = published("m 1\n");
        let now = Instant::now();
        assert_eq!(answer_of(&request(Method::GET, "/metrics", &[]), &state, now).await, (StatusCode::OK, "m 1\n".into()));
        assert_eq!(answer_of(&request(Method::GET, "/metrics?x=1", &[]), &state, now).await.0, StatusCode::OK);
        assert_eq!(answer_of(&request(Method::HEAD, "/healthz", &[]), &state, now).await, (StatusCode::OK, "ok\n".into()));
        assert_eq!(answer_of(&request(Method::GET, "/readyz", &[]), &state, now).await, (StatusCode::OK, "ready\n".into()));
        assert_eq!(answer_of(&request(Method::GET, "/nothing", &[]), &state, now).await.0, StatusCode::NOT_FOUND);
        assert_eq!(answer_of(&request(Method::POST, "/nothing", &[]), &state, now).await.0, StatusCode::NOT_FOUND);
        let post = respond(&request(Method::POST, "/metrics", &[]), &state, &progress(), now);
        assert_eq!(post.status(), StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(post.headers().get(ALLOW).map(HeaderValue::as_bytes), Some(&b"GET, HEAD"[..]));
        assert_eq!(answer_of(&request(Method::DELETE, "/healthz", &[]), &state, now).await.0, StatusCode::METHOD_NOT_ALLOWED);
        // Bodies are refused; an explicit empty one is none.
        assert_eq!(answer_of(&request(Method::GET, "/metrics", &[("content-length", "5")]), &state, now).await.0, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(answer_of(&request(Method::GET, "/metrics", &[("transfer-encoding", "chunked")]), &state, now).await.0, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(answer_of(&request(Method::GET, "/metrics", &[("content-length", "0")]), &state, now).await.0, StatusCode::OK);
    }

    #[tokio::test]
    async fn readiness_health_and_encoding_failures() {
        let not_ready = Published { not_ready: Some("no libcuda probed"), ..published("") };
        assert_eq!(
            answer_of(&request(Method::GET, "/readyz", &[]), &not_ready, Instant::now()).await,
            (StatusCode::SERVICE_UNAVAILABLE, "no libcuda probed\n".into())
        );
        let state = published("");
        let at = Instant::now();
        let healthz = |now| respond(&request(Method::GET, "/healthz", &[]), &state, &Progress { at, passes: 0 }, now);
        assert_eq!(healthz(at + STALE_AFTER).status(), StatusCode::OK);
        let response = healthz(at + STALE_AFTER * 2);
        let status = response.status();
        let body = String::from_utf8_lossy(&response.into_body().collect().await.expect("body").to_bytes()).into_owned();
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "the event loop published nothing for a minute");
        assert!(body.starts_with("no reconcile pass for 60 s"), "{body}");
        let broken = Published { metrics: Err("bad family".into()), ..published("") };
        assert_eq!(answer_of(&request(Method::GET, "/metrics", &[]), &broken, Instant::now()).await.0, StatusCode::INTERNAL_SERVER_ERROR);
    }

    /// A listener on a free loopback port serving `metrics`.
    async fn listener(limits: Limits, metrics: Bytes) -> (SocketAddr, Connections, Publisher, Arc<Notify>) {
        let connections = Connections::new().expect("counter");
        let wanted = Arc::new(Notify::new());
        let (publisher, board) = Publisher::new(Published { metrics: Ok(metrics), not_ready: None, passes: 0 }, wanted.clone());
        let (addr, serving) = serve("127.0.0.1:0".parse().expect("addr"), limits, board, connections.clone()).await.expect("serve");
        tokio::spawn(serving);
        (addr, connections, publisher, wanted)
    }

    /// Sends `request` on a new connection and reads until the server closes it.
    async fn exchange(addr: SocketAddr, request: &[u8]) -> Vec<u8> {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        stream.write_all(request).await.expect("send");
        read_all(&mut stream).await
    }

    /// Everything the server sends until it closes (a reset ends it too).
    async fn read_all(stream: &mut TcpStream) -> Vec<u8> {
        let mut answer = Vec::new();
        match stream.read_to_end(&mut answer).await {
            Ok(_) => {}
            Err(error) if error.kind() == ErrorKind::ConnectionReset => {}
            Err(error) => panic!("reading the answer: {error}"),
        }
        answer
    }

    fn status_of(answer: &[u8]) -> String {
        String::from_utf8_lossy(answer).lines().next().unwrap_or_default().to_string()
    }

    /// Waits (a bounded number of scheduler turns) for `outcome` to reach `count`.
    async fn counted(connections: &Connections, outcome: Outcome, count: u64) {
        for _ in 0..500 {
            if connections.get(outcome) >= count {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("{outcome:?}: {} connections counted, {count} expected", connections.get(outcome));
    }

    fn small(connections: usize) -> Limits {
        Limits { connections, header_timeout: Duration::from_millis(300), deadline: Duration::from_secs(5), head_bytes: 8192, headers: 8 }
    }

    #[tokio::test]
    async fn serves_over_tcp_and_head_has_no_body() {
        let (addr, connections, board, _) = listener(small(4), Bytes::from_static(b"m 1\n")).await;
        let answer = exchange(addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await;
        let text = String::from_utf8_lossy(&answer);
        assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
        assert!(text.contains("content-length: 4\r\n") && text.ends_with("\r\n\r\nm 1\n"), "{text}");
        let answer = String::from_utf8_lossy(&exchange(addr, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await).into_owned();
        assert!(answer.starts_with("HTTP/1.1 200 OK\r\n") && answer.ends_with("\r\n\r\n"), "HEAD: no body: {answer}");
        // A new pass's page is what the next request gets.
        board.publish(published("m 2\n"));
        assert!(String::from_utf8_lossy(&exchange(addr, b"GET /metrics HTTP/1.0\r\n\r\n").await).ends_with("m 2\n"));
        // A page far larger than the read buffer comes whole.
        let large = "x".repeat(4 << 20);
        board.publish(published(&large));
        let answer = exchange(addr, b"GET /metrics HTTP/1.1\r\n\r\n").await;
        assert!(answer.ends_with(large.as_bytes()), "{} bytes", answer.len());
        counted(&connections, Outcome::Answered, 4).await;
    }

    #[tokio::test]
    async fn a_scrape_behind_the_loop_asks_for_the_page_of_its_last_pass() {
        let (addr, _connections, publisher, wanted) = listener(small(4), Bytes::from_static(b"pass 0\n")).await;
        // The page is current: served as it is, the loop is not asked.
        assert!(String::from_utf8_lossy(&exchange(addr, b"GET /metrics HTTP/1.1\r\n\r\n").await).ends_with("pass 0\n"));
        // A pass: the next scrape rings, the loop renders, the scrape gets that page.
        publisher.passed(1);
        assert!(publisher.behind());
        let publisher = Arc::new(publisher);
        let event_loop = {
            let publisher = publisher.clone();
            tokio::spawn(async move {
                wanted.notified().await;
                publisher.publish(Published { passes: 1, ..published("pass 1\n") });
            })
        };
        assert!(String::from_utf8_lossy(&exchange(addr, b"GET /metrics HTTP/1.1\r\n\r\n").await).ends_with("pass 1\n"));
        event_loop.await.expect("loop");
        assert!(!publisher.behind());
    }

    #[tokio::test]
    async fn oversized_heads_get_431() {
        let (addr, connections, _board, _) = listener(small(4), Bytes::from_static(b"m 1\n")).await;
        let big = format!("GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: {}\r\n\r\n", "a".repeat(9000));
        assert_eq!(status_of(&exchange(addr, big.as_bytes()).await), "HTTP/1.1 431 Request Header Fields Too Large");
        let many: String = (0..9).map(|i| format!("X-{i}: y\r\n")).collect();
        let many = format!("GET /metrics HTTP/1.1\r\n{many}\r\n");
        assert_eq!(status_of(&exchange(addr, many.as_bytes()).await), "HTTP/1.1 431 Request Header Fields Too Large");
        counted(&connections, Outcome::BadRequest, 2).await;
        // Within the limits: answered.
        let fine = format!("GET /metrics HTTP/1.1\r\nX-Pad: {}\r\n\r\n", "a".repeat(4000));
        assert_eq!(status_of(&exchange(addr, fine.as_bytes()).await), "HTTP/1.1 200 OK");
    }

    #[tokio::test]
    async fn a_slow_head_is_cut_off() {
        let (addr, connections, _board, _) = listener(small(4), Bytes::from_static(b"m 1\n")).await;
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        stream.write_all(b"GET /metr").await.expect("send");
        let answer = read_all(&mut stream).await;
        assert!(!status_of(&answer).contains("200"), "never answered: {answer:?}");
        counted(&connections, Outcome::TimedOut, 1).await;
    }

    #[tokio::test]
    async fn a_client_that_does_not_read_is_cut_off_at_the_deadline() {
        let body = Bytes::from(vec![b'x'; 64 << 20]);
        let limits = Limits { deadline: Duration::from_millis(500), ..small(4) };
        let (addr, connections, _board, _) = listener(limits, body.clone()).await;
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        stream.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").await.expect("send");
        counted(&connections, Outcome::TimedOut, 1).await;
        let answer = read_all(&mut stream).await;
        assert!(answer.len() < body.len(), "the answer was cut short: {} bytes", answer.len());
    }

    #[tokio::test]
    async fn idle_connections_past_the_cap_make_room() {
        let limits = Limits { header_timeout: Duration::from_secs(30), deadline: Duration::from_secs(30), ..small(4) };
        let (addr, connections, _board, _) = listener(limits, Bytes::from_static(b"m 1\n")).await;
        let mut idle = Vec::new();
        for n in 1..=10u64 {
            idle.push(TcpStream::connect(addr).await.expect("connect"));
            if n > 4 {
                counted(&connections, Outcome::Evicted, n - 4).await;
            }
        }
        // The six oldest were closed to make room; the four youngest are still open.
        for (n, stream) in idle.iter_mut().enumerate() {
            let mut byte = [0u8; 1];
            let read = tokio::time::timeout(Duration::from_millis(50), stream.read(&mut byte)).await;
            assert_eq!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), n < 6, "connection {n}: {read:?}");
        }
        assert_eq!(status_of(&exchange(addr, b"GET /metrics HTTP/1.1\r\n\r\n").await), "HTTP/1.1 200 OK");
        assert_eq!(connections.get(Outcome::Refused), 0);
        counted(&connections, Outcome::Evicted, 7).await;
    }

    #[tokio::test]
    async fn past_the_cap_with_every_connection_answered_newcomers_are_refused() {
        let body = Bytes::from(vec![b'x'; 64 << 20]);
        let limits = Limits { header_timeout: Duration::from_secs(30), deadline: Duration::from_secs(30), ..small(2) };
        let (addr, connections, _board, _) = listener(limits, body).await;
        // Two clients that asked and do not read: their answers are stuck in flight.
        let mut stuck = Vec::new();
        for _ in 0..2 {
            let mut stream = TcpStream::connect(addr).await.expect("connect");
            stream.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").await.expect("send");
            stuck.push(stream);
        }
        // Let both requests arrive.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let answer = exchange(addr, b"GET /healthz HTTP/1.1\r\n\r\n").await;
        assert!(answer.is_empty(), "closed at once, unanswered: {}", String::from_utf8_lossy(&answer));
        counted(&connections, Outcome::Refused, 1).await;
        assert_eq!(connections.get(Outcome::Evicted), 0, "connections being answered are never evicted");
        // Once they go, there is room again.
        drop(stuck);
        for _ in 0..500 {
            if status_of(&exchange(addr, b"GET /healthz HTTP/1.1\r\n\r\n").await) == "HTTP/1.1 200 OK" {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("no room after the stuck clients left");
    }
}
