//! Serving the agent's state over HTTP (`--metrics-addr`): [`http`] is the listener and its
//! limits, [`gate`] its connection cap. The event loop renders what the listener serves after
//! each reconcile pass and leaves it in a [`Published`] (through a `tokio::sync::watch`
//! channel); a request only reads the latest one, so a scrape never runs a pass and a flood of
//! scrapes costs the event loop nothing.
pub mod gate;
pub mod http;

use std::time::Instant;

use bytes::Bytes;

/// What the listener serves, as of the event loop's last pass.
#[derive(Clone, Debug)]
pub struct Published {
    /// `/metrics`: the text exposition format, or why it could not be encoded.
    pub metrics: Result<Bytes, String>,
    /// `/readyz`: why the agent is not ready (`None`: ready).
    pub not_ready: Option<&'static str>,
    /// When the pass ended; `/healthz` fails once it is [`http::STALE_AFTER`] old.
    pub at: Instant,
}
