//! A minimal HTTP/1.x server for `--metrics-addr`: `GET` (or `HEAD`) of a path, one request
//! per connection, `Connection: close`. Each connection gets a task that reads the request
//! head (at most [`MAX_HEAD`] bytes within [`READ_TIMEOUT`]) and hands the path to the agent's
//! main loop over a channel; the main loop answers through a oneshot, so responses are built
//! from the agent's state without sharing it across tasks, and a slow client never stalls
//! the main loop.
use std::{net::SocketAddr, time::Duration};

use anyhow::{Context, Result};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::{mpsc, oneshot},
    time::timeout,
};
use tracing::debug;

/// The largest request head read.
const MAX_HEAD: usize = 8192;
/// How long a client may take to send its request head.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// A request for the main loop to answer.
pub struct Request {
    /// The path, without the query string.
    pub path: String,
    pub reply: oneshot::Sender<Response>,
}

pub struct Response {
    pub status: u16,
    pub content_type: &'static str,
    pub body: String,
}

impl Response {
    pub fn text(status: u16, body: impl Into<String>) -> Response {
        Response { status, content_type: "text/plain; charset=utf-8", body: body.into() }
    }
}

/// Binds `addr` and serves it in the background; requests arrive on the returned channel.
pub async fn serve(addr: SocketAddr) -> Result<(SocketAddr, mpsc::Receiver<Request>)> {
    let listener = TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr} for metrics"))?;
    let bound = listener.local_addr().context("the metrics listener has no address")?;
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            match listener.accept().await {
                Ok((stream, peer)) => {
                    let tx = tx.clone();
                    tokio::spawn(async move {
                        if let Err(error) = connection(stream, tx).await {
                            debug!(%peer, error = %format!("{error:#}"), "metrics client");
                        }
                    });
                }
                Err(error) => {
                    debug!(%error, "metrics accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    });
    Ok((bound, rx))
}

async fn connection(mut stream: TcpStream, tx: mpsc::Sender<Request>) -> Result<()> {
    let head = timeout(READ_TIMEOUT, read_head(&mut stream)).await.context("the client was too slow")??;
    let response = match parse_request_line(&head) {
        Err(status) => Response::text(status, "bad request\n"),
        Ok((method, path)) => {
            let (reply, answer) = oneshot::channel();
            tx.send(Request { path, reply }).await.context("the agent is stopping")?;
            let mut response = answer.await.context("the agent dropped the request")?;
            if method == "HEAD" {
                response.body.clear();
            }
            response
        }
    };
    let head = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        response.status,
        reason(response.status),
        response.content_type,
        response.body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(response.body.as_bytes()).await?;
    stream.shutdown().await?;
    Ok(())
}

/// Reads until the blank line that ends the head (or the client stops sending).
async fn read_head(stream: &mut TcpStream) -> Result<Vec<u8>> {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while head.len() < MAX_HEAD {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
        if head.windows(4).any(|w| w == b"\r\n\r\n") || head.windows(2).any(|w| w == b"\n\n") {
            break;
        }
    }
    Ok(head)
}

/// (method, path) of `GET /path?query HTTP/1.1`; Err(status) for what is not served.
fn parse_request_line(head: &[u8]) -> Result<(String, String), u16> {
    let line_end = head.iter().position(|&b| b == b'\n').ok_or(400u16)?;
    let line = std::str::from_utf8(&head[..line_end]).map_err(|_| 400u16)?.trim_end_matches('\r');
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) = (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(400);
    };
    if !version.starts_with("HTTP/1.") || !target.starts_with('/') {
        return Err(400);
    }
    if method != "GET" && method != "HEAD" {
        return Err(405);
    }
    let path = target.split('?').next().unwrap_or(target);
    Ok((method.to_string(), path.to_string()))
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_request_lines() {
        assert_eq!(parse_request_line(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"), Ok(("GET".into(), "/metrics".into())));
        assert_eq!(parse_request_line(b"HEAD /healthz?x=1 HTTP/1.0\n\n"), Ok(("HEAD".into(), "/healthz".into())));
        assert_eq!(parse_request_line(b"POST /metrics HTTP/1.1\r\n\r\n"), Err(405));
        assert_eq!(parse_request_line(b"GET metrics HTTP/1.1\r\n\r\n"), Err(400));
        assert_eq!(parse_request_line(b"GET /metrics\r\n\r\n"), Err(400));
        assert_eq!(parse_request_line(b"\xff\xfe /x HTTP/1.1\r\n"), Err(400));
        assert_eq!(parse_request_line(b"GET /x HTTP/1.1"), Err(400));
    }
}
