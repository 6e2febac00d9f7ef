//! A tiny HTTP/1.1 client (one `GET` over a plain TCP connection, `Connection: close`) and a
//! parser of the Prometheus text format, for scraping `vramguard run --metrics-addr`.
//!
//! The agent serves the metrics page of its last reconcile pass (a pass runs at least every
//! second; a scrape runs none): [`scrape`] reads it, [`fresh_scrape`] waits for the page of a
//! pass that began after the call, for a test that has just changed the node.
use std::{
    collections::BTreeMap,
    io::{ErrorKind, Read, Write},
    net::{SocketAddr, TcpStream},
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context, Result};

/// `GET path` from `addr`: (status, body).
pub fn get(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    let response = raw(addr, request.as_bytes()).with_context(|| format!("GET {path}"))?;
    let text = String::from_utf8(response).context("the answer is not UTF-8")?;
    let (head, body) = text.split_once("\r\n\r\n").ok_or_else(|| anyhow!("no end of head in {text:?}"))?;
    let status_line = head.lines().next().unwrap_or_default();
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow!("bad status line {status_line:?}"))?;
    Ok((status, body.to_string()))
}

/// `GET /metrics` from `addr`, parsed; fails unless the status is 200.
pub fn scrape(addr: SocketAddr) -> Result<Vec<Sample>> {
    parse_metrics(&page(addr)?)
}

/// Sends `request` as it is on a new connection to `addr` and returns every byte of the answer
/// until the agent closes the connection (a reset after some of the answer ends it too: a
/// server that refuses a request it has not read whole closes with unread bytes, and the
/// kernel resets the connection then).
pub fn raw(addr: SocketAddr, request: &[u8]) -> Result<Vec<u8>> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).with_context(|| format!("cannot connect to {addr}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    stream.write_all(request).context("sending the request")?;
    let mut response = Vec::new();
    match stream.read_to_end(&mut response) {
        Err(error) if error.kind() == ErrorKind::ConnectionReset && !response.is_empty() => Ok(response),
        Err(error) => Err(error).context("reading the answer"),
        Ok(_) => Ok(response),
    }
}

/// The family that counts the agent's reconcile passes.
pub const PASSES: &str = "vramguard_reconcile_pass_seconds_count";

/// `GET /metrics` from `addr` once the agent has published a pass that began after the call:
/// the body of a page that reflects the node as of now (fails unless the status is 200).
pub fn fresh(addr: SocketAddr) -> Result<String> {
    let first = page(addr)?;
    let passes = |body: &str| -> Result<f64> {
        metric(&parse_metrics(body)?, PASSES, &[]).ok_or_else(|| anyhow!("no {PASSES} in the scrape"))
    };
    let seen = passes(&first)?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        // `first` was the page of the last pass, and no pass was running when it was served
        // (the agent's event loop is one thread): the next pass began after.
        let body = page(addr)?;
        if passes(&body)? > seen {
            return Ok(body);
        }
        if Instant::now() > deadline {
            bail!("no reconcile pass published within 10 s of {seen} passes");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// [`fresh`], parsed.
pub fn fresh_scrape(addr: SocketAddr) -> Result<Vec<Sample>> {
    parse_metrics(&fresh(addr)?)
}

/// The body of `GET /metrics`; fails unless the status is 200.
fn page(addr: SocketAddr) -> Result<String> {
    let (status, body) = get(addr, "/metrics")?;
    if status != 200 {
        bail!("GET /metrics: {status} {body}");
    }
    Ok(body)
}

/// The samples of family `name`.
pub fn samples<'a>(all: &'a [Sample], name: &'a str) -> impl Iterator<Item = &'a Sample> + 'a {
    all.iter().filter(move |s| s.name == name)
}

/// The value of the first sample `name` whose labels include every `(key, value)` of
/// `labels`.
pub fn metric(all: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples(all, name).find(|s| labels.iter().all(|(k, v)| s.label(k) == *v)).map(|s| s.value)
}

/// One sample of the text format.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

impl Sample {
    pub fn label(&self, key: &str) -> &str {
        self.labels.get(key).map(String::as_str).unwrap_or("")
    }
}

/// Every sample of a scrape (comments and blank lines skipped).
pub fn parse_metrics(text: &str) -> Result<Vec<Sample>> {
    text.lines()
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .map(|line| parse_line(line).with_context(|| format!("bad metrics line {line:?}")))
        .collect()
}

fn parse_line(line: &str) -> Result<Sample> {
    let name_end = line.find(['{', ' ']).ok_or_else(|| anyhow!("no value"))?;
    let name = line[..name_end].to_string();
    let mut labels = BTreeMap::new();
    let mut rest = &line[name_end..];
    if let Some(inner) = rest.strip_prefix('{') {
        let mut chars = inner.char_indices();
        let mut key = String::new();
        loop {
            let Some((i, c)) = chars.next() else { bail!("unterminated labels") };
            match c {
                '}' => {
                    rest = &inner[i + 1..];
                    break;
                }
                ',' | ' ' => {}
                '=' => {
                    if chars.next().map(|(_, c)| c) != Some('"') {
                        bail!("label {key} has no quoted value");
                    }
                    let mut value = String::new();
                    loop {
                        match chars.next().map(|(_, c)| c) {
                            Some('"') => break,
                            Some('\\') => match chars.next().map(|(_, c)| c) {
                                Some('n') => value.push('\n'),
                                Some(other) => value.push(other),
                                None => bail!("unterminated escape"),
                            },
                            Some(other) => value.push(other),
                            None => bail!("unterminated label value"),
                        }
                    }
                    labels.insert(std::mem::take(&mut key), value);
                }
                other => key.push(other),
            }
        }
    }
    let value_text = rest.split_whitespace().next().ok_or_else(|| anyhow!("no value"))?;
    let value = match value_text {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        text => text.parse().with_context(|| format!("bad value {text:?}"))?,
    };
    Ok(Sample { name, labels, value })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_text_format() {
        let text = "# HELP x y\n# TYPE x gauge\nx 3\ny{a=\"1\",b=\"q\\\"uote\"} 2.5\nh_bucket{le=\"+Inf\"} 4\n";
        let samples = parse_metrics(text).expect("parse");
        assert_eq!(samples.len(), 3);
        assert_eq!(samples[0], Sample { name: "x".into(), labels: BTreeMap::new(), value: 3.0 });
        assert_eq!(samples[1].label("a"), "1");
        assert_eq!(samples[1].label("b"), "q\"uote");
        assert_eq!(samples[1].value, 2.5);
        assert_eq!(samples[2].label("le"), "+Inf");
    }
}
