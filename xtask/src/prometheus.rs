//! `cargo xtask setup`'s Prometheus part: Debian's `prometheus` and `promtool`
//! (`e2e::prometheus::PACKAGES`) cached in `target/prometheus/` the way containerd is
//! ([`crate::containerd::setup_set`]: a private apt state, `apt-get download`, `dpkg-deb -x`),
//! for the monitoring tests (`promtool test rules` over the alert rules, a real Prometheus
//! scraping the agent).
use anyhow::Result;
use e2e::prometheus::{cache_dir_in, PACKAGES};

/// Fills `target/prometheus/` unless it is complete; both binaries must run here.
pub fn setup() -> Result<()> {
    let dir = cache_dir_in(&crate::containerd::target());
    crate::containerd::setup_set("prometheus", PACKAGES, &dir, &["prometheus", "promtool"])
}
