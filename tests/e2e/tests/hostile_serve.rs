//! The agent's only network surface, `--metrics-addr`, under attack (issue 12, "Scrapes are
//! cheap and the listener is not home-made"). Each test runs the real agent watching a
//! ledger directory with a bystander container in it, attacks the listener from this
//! process's sockets, and asserts while the attack runs that the agent serves `/metrics` and
//! reclaims a killed bystander process within 1 s ([`e2e::hostile`]):
//! - a slowloris holding far more connections than the listener's cap, idle or sending their
//!   head a byte at a time, does not keep a new scraper out (the cap is reached: connections
//!   are evicted, counted in `vramguard_http_connections_total{outcome="evicted"}`);
//! - an oversized request head is refused with `431` (a small one is answered), and the
//!   agent stays up;
//! - a burst of scrapes runs no reconcile pass: `vramguard_reconcile_pass_seconds_count` grows
//!   by what the one-a-second timer explains, far less than the number of scrapes, while the
//!   same number of `vramguard audit`s (which do run a pass each) moves it by as many.
//! - (issue 17) the health listener (`--health-addr`) answers `/healthz` within 250 ms
//!   throughout while the slowloris holds the metrics listener past its cap with idle and
//!   dripping connections; the same probes with no attack are the negative control.
//!
//! Needs root; run with `cargo xtask test`.
//!
//! Bounds latency: /healthz answers within 250 ms under attack.
use std::{
    io::{ErrorKind, Write},
    net::{SocketAddr, TcpStream},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{anyhow, ensure, Context, Result};
use e2e::{
    agent::Agent,
    hostile::{assert_serving, Bystander, HealthProbe},
    http::{self, fresh_scrape, metric, Sample, PASSES},
    FakeNode, TempDir,
};

/// The listener's connection cap (`LIMITS.connections` in `agent/src/serve/http.rs`).
const CAP: usize = 64;

/// An agent watching a fresh ledger directory (and serving health on a listener of its own),
/// with a bystander container in it.
fn agent_with_bystander(tag: &str) -> Result<(TempDir, Agent, Bystander)> {
    let node = FakeNode::new(tag);
    let dir = TempDir::new(tag)?;
    let agent = Agent::watching(&dir.0, &[std::ffi::OsStr::new("--health-addr"), std::ffi::OsStr::new("127.0.0.1:0")])?;
    let bystander = Bystander::start(&node, &dir, &agent)?;
    Ok((dir, agent, bystander))
}

/// `vramguard_http_connections_total{outcome}` in a scrape.
fn connections(all: &[Sample], outcome: &str) -> f64 {
    metric(all, "vramguard_http_connections_total", &[("outcome", outcome)]).unwrap_or(0.0)
}

fn passes(all: &[Sample]) -> Result<f64> {
    metric(all, PASSES, &[]).ok_or_else(|| anyhow!("no {PASSES} in the scrape"))
}

/// The status line of an answer.
fn status_line(answer: &[u8]) -> String {
    String::from_utf8_lossy(answer).lines().next().unwrap_or_default().to_string()
}

/// A slowloris: keeps up to `want` connections to the listener open, half of them idle (they
/// never send a byte), half sending a request head that never ends, a byte every 100 ms;
/// reopens (at most 20 every 10 ms) what the agent closes.
struct Slowloris {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Result<Held>>,
}

/// What the slowloris managed.
#[derive(Debug)]
struct Held {
    opened: u64,
    closed_by_agent: u64,
    most_open: usize,
    slow_connects: u64,
}

impl Slowloris {
    fn start(addr: SocketAddr, want: usize) -> Slowloris {
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let thread = std::thread::spawn(move || -> Result<Held> {
            const HEAD: &[u8] = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ";
            let mut open: Vec<(TcpStream, bool, usize)> = Vec::new();
            let mut held = Held { opened: 0, closed_by_agent: 0, most_open: 0, slow_connects: 0 };
            let mut last_byte = Instant::now();
            while !stopping.load(Ordering::Relaxed) {
                for _ in 0..want.saturating_sub(open.len()).min(20) {
                    // The agent closes first, so the many closed connections sit in TIME_WAIT on
                    // its side: a new one that lands on such a port pair waits for a SYN
                    // retransmission (1 s). Counted, and tried again next round.
                    let Ok(stream) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
                        held.slow_connects += 1;
                        break;
                    };
                    stream.set_nonblocking(true)?;
                    // Every other connection drips its endless head.
                    open.push((stream, held.opened.is_multiple_of(2), 0));
                    held.opened += 1;
                }
                held.most_open = held.most_open.max(open.len());
                let drip = last_byte.elapsed() >= Duration::from_millis(100);
                if drip {
                    last_byte = Instant::now();
                }
                let before = open.len();
                open.retain_mut(|(stream, drips, sent)| {
                    if drip && *drips {
                        let byte = HEAD.get(*sent).copied().unwrap_or(b'a');
                        match stream.write(&[byte]) {
                            Ok(_) => *sent += 1,
                            Err(error) if error.kind() == ErrorKind::WouldBlock => {}
                            Err(_) => return false,
                        }
                    }
                    // Closed (or answered, which closes it): gone.
                    let mut byte = [0u8; 1];
                    matches!(stream.peek(&mut byte), Err(error) if error.kind() == ErrorKind::WouldBlock)
                });
                held.closed_by_agent += (before - open.len()) as u64;
                std::thread::sleep(Duration::from_millis(10));
            }
            Ok(held)
        });
        Slowloris { stop, thread }
    }

    fn stop(self) -> Result<Held> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().map_err(|_| anyhow!("the slowloris thread panicked"))?
    }
}

#[test]
fn a_slowloris_past_the_cap_does_not_keep_scrapers_out() -> Result<()> {
    let (_dir, agent, mut bystander) = agent_with_bystander("hostile-serve-slowloris")?;
    let addr = agent.metrics_addr()?;
    let before = fresh_scrape(addr)?;
    ensure!(connections(&before, "evicted") == 0.0, "nothing evicted before the attack");

    let attack = Slowloris::start(addr, 4 * CAP);
    // Let it fill the listener.
    std::thread::sleep(Duration::from_secs(1));
    for round in 0..20 {
        let (status, body) = http::get(addr, "/metrics").with_context(|| format!("scrape {round} during the attack"))?;
        ensure!(status == 200 && body.contains(PASSES), "scrape {round} during the attack: {status} {body:.200}");
        ensure!(http::get(addr, "/healthz")?.0 == 200, "/healthz during the attack");
        std::thread::sleep(Duration::from_millis(50));
    }
    bystander.kill_and_expect_reclaim(&agent)?;
    assert_serving(&agent)?;
    let held = attack.stop()?;
    eprintln!("slowloris: {held:?}");

    // The attack did reach the cap: it held more connections than the listener takes, and the
    // agent closed some to make room.
    ensure!(held.most_open > CAP, "the slowloris held {} connections at most, the cap is {CAP}", held.most_open);
    ensure!(held.closed_by_agent > 0, "the agent closed none of the slowloris's connections: {held:?}");
    let after = fresh_scrape(addr)?;
    let evicted = connections(&after, "evicted");
    ensure!(evicted > 0.0, "no connection evicted: the cap was never reached");
    ensure!(connections(&after, "answered") >= 40.0, "the scrapes and health checks were answered and counted");
    eprintln!(
        "connections by outcome after the attack: answered {}, evicted {evicted}, timed_out {}, refused {}",
        connections(&after, "answered"),
        connections(&after, "timed_out"),
        connections(&after, "refused")
    );
    ensure!(agent.log().contains("at its connection cap"), "the cap is logged: {}", agent.log());
    agent.stop()?;
    Ok(())
}

/// `/healthz` on the health listener, every 100 ms for 3 s, with `attack` on the metrics
/// listener (or none); fails unless every probe answered 200 within 250 ms.
fn health_while(attack: bool) -> Result<()> {
    let (_dir, agent, mut bystander) = agent_with_bystander(if attack { "hostile-serve-health" } else { "hostile-serve-health-control" })?;
    let (metrics, health) = (agent.metrics_addr()?, agent.health_addr()?);
    ensure!(metrics != health, "one listener for both");
    let slowloris = attack.then(|| Slowloris::start(metrics, 4 * CAP));
    // Let it fill the metrics listener.
    std::thread::sleep(Duration::from_secs(1));
    let probe = HealthProbe::start(health, Duration::from_millis(100));
    std::thread::sleep(Duration::from_secs(3));
    probe.finish()?;
    bystander.kill_and_expect_reclaim(&agent)?;
    if let Some(slowloris) = slowloris {
        let held = slowloris.stop()?;
        ensure!(held.most_open > CAP, "the slowloris held {} connections at most, the cap is {CAP}", held.most_open);
    }
    assert_serving(&agent)?;
    agent.stop()?;
    Ok(())
}

#[test]
fn the_health_listener_answers_while_the_metrics_listener_is_held_past_its_cap() -> Result<()> {
    health_while(true)
}

#[test]
fn the_health_listener_answers_without_an_attack() -> Result<()> {
    health_while(false)
}

#[test]
fn an_oversized_request_head_is_refused_and_the_agent_stays_up() -> Result<()> {
    let (_dir, agent, mut bystander) = agent_with_bystander("hostile-serve-oversized")?;
    let addr = agent.metrics_addr()?;
    let request = |pad: usize, fields: usize| -> Vec<u8> {
        let extra: String = (0..fields).map(|i| format!("X-Field-{i}: y\r\n")).collect();
        format!("GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: {}\r\n{extra}\r\n", "a".repeat(pad)).into_bytes()
    };
    // Negative control: a head within the limits (4 KiB, 20 fields) is answered.
    assert_eq!(status_line(&http::raw(addr, &request(4096, 20))?), "HTTP/1.1 200 OK");
    // A head over 8 KiB, and one with 100 fields: refused.
    for (what, pad, fields) in [("a 9 KiB field", 9 * 1024, 0), ("a 64 KiB field", 64 * 1024, 0), ("100 fields", 0, 100)] {
        let answer = http::raw(addr, &request(pad, fields)).with_context(|| what.to_string())?;
        assert_eq!(status_line(&answer), "HTTP/1.1 431 Request Header Fields Too Large", "{what}");
    }
    bystander.kill_and_expect_reclaim(&agent)?;
    assert_serving(&agent)?;
    let all = fresh_scrape(addr)?;
    ensure!(connections(&all, "bad_request") >= 3.0, "the refusals are counted: {}", connections(&all, "bad_request"));
    agent.stop()?;
    Ok(())
}

#[test]
fn scrapes_do_not_run_reconcile_passes() -> Result<()> {
    let (_dir, agent, mut bystander) = agent_with_bystander("hostile-serve-burst")?;
    let addr = agent.metrics_addr()?;
    let stop = Arc::new(AtomicBool::new(false));
    let scrapes = Arc::new(AtomicU64::new(0));
    let burst: Vec<JoinHandle<Result<()>>> = (0..4)
        .map(|_| {
            let (stop, scrapes) = (stop.clone(), scrapes.clone());
            std::thread::spawn(move || -> Result<()> {
                while !stop.load(Ordering::Relaxed) {
                    http::scrape(addr)?;
                    scrapes.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            })
        })
        .collect();

    // A window of the burst, with nothing else happening on the node.
    let first = passes(&http::scrape(addr)?)?;
    let (started, scraped) = (Instant::now(), scrapes.load(Ordering::Relaxed));
    std::thread::sleep(Duration::from_secs(3));
    let last = passes(&http::scrape(addr)?)?;
    let (window, scraped) = (started.elapsed(), scrapes.load(Ordering::Relaxed) - scraped);
    let grown = last - first;
    eprintln!("{scraped} scrapes in {window:?}: the pass count grew by {grown}");
    ensure!(scraped >= 100, "a burst: {scraped} scrapes in {window:?}");
    // The timer's pass a second (plus the page being up to a pass behind at either end).
    ensure!(grown <= window.as_secs_f64().ceil() + 2.0, "{grown} passes in {window:?} of {scraped} scrapes");
    ensure!(grown * 10.0 < scraped as f64, "{grown} passes for {scraped} scrapes");
    // The count does move with time.
    ensure!(grown >= 1.0, "no pass at all in {window:?}");

    // The bystander still reclaimed, the agent still serving, during the burst.
    bystander.kill_and_expect_reclaim(&agent)?;
    assert_serving(&agent)?;
    stop.store(true, Ordering::Relaxed);
    for thread in burst {
        thread.join().map_err(|_| anyhow!("a scraper panicked"))??;
    }

    // Negative control: what does run a pass each (a `vramguard audit`) moves the count by
    // at least as many.
    let before = passes(&fresh_scrape(addr)?)?;
    const AUDITS: u32 = 20;
    for _ in 0..AUDITS {
        agent.audit()?;
    }
    let after = passes(&fresh_scrape(addr)?)?;
    ensure!(after - before >= f64::from(AUDITS), "{AUDITS} audits moved the pass count by {}", after - before);
    agent.stop()?;
    Ok(())
}
