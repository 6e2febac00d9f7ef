//! A real Prometheus for the monitoring tests: Debian's `prometheus` and `promtool` packages,
//! cached by `cargo xtask setup` in `target/prometheus/` ([`PACKAGES`], the same private way
//! as containerd's, [`crate::containerd::Cache`]), and what the tests read from the shipped
//! manifests: the alert rules of `deploy/kubernetes/prometheusrule.yaml` as a plain rules file
//! ([`rules_file`]) and a scrape configuration equivalent to
//! `deploy/kubernetes/servicemonitor.yaml` ([`scrape_config`]).
//!
//! [`Prometheus::start`] runs `prometheus` on a free local port with its data in a temporary
//! directory and waits until it is ready; [`Prometheus::query`] asks its HTTP API. Dropping it
//! kills the process and removes the directory.
use std::{
    net::{SocketAddr, TcpListener},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use anyhow::{anyhow, bail, ensure, Context, Result};
use serde_json::{json, Value};

use crate::containerd::{Cache, Package};
use crate::{wait_for, TempDir};

/// What `cargo xtask setup` fetches: Prometheus 2.53 (an LTS release) and its `promtool`,
/// from trixie (bookworm's 2.42 has no separate `promtool` package and is older); both are
/// Go programs that need only glibc 2.34.
pub const PACKAGES: &[Package] = &[
    Package { name: "prometheus", suite: "trixie", files: &["usr/bin/prometheus"] },
    Package { name: "promtool", suite: "trixie", files: &["usr/bin/promtool"] },
];

/// The cache directory of the target directory `target` (`target/prometheus`).
pub fn cache_dir_in(target: &Path) -> PathBuf {
    target.join("prometheus")
}

/// The cache of the target directory this test binary was built in.
pub fn cache() -> Result<Cache> {
    let profile = crate::target_dir()?;
    let target = profile.parent().ok_or_else(|| anyhow!("{} has no parent", profile.display()))?;
    Cache::open_set(&cache_dir_in(target), PACKAGES)
}

/// The repository's root (two levels above this crate).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A YAML file of the repository, as JSON values.
pub fn read_yaml(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_yaml::from_str(&text).with_context(|| format!("{} is not valid YAML", path.display()))
}

/// The rule groups of the PrometheusRule manifest at `manifest` as a plain Prometheus rules
/// file (`groups:` as the CR's `spec.groups`), in JSON (which Prometheus reads as YAML).
pub fn rules_file(manifest: &Path) -> Result<String> {
    let rule = read_yaml(manifest)?;
    ensure!(rule["kind"] == "PrometheusRule", "{} is not a PrometheusRule", manifest.display());
    let groups = rule["spec"]["groups"].as_array().with_context(|| format!("{} has no spec.groups", manifest.display()))?;
    Ok(serde_json::to_string_pretty(&json!({ "groups": groups }))?)
}

/// The names of every alert in the rules of the PrometheusRule manifest at `manifest`.
pub fn alert_names(manifest: &Path) -> Result<Vec<String>> {
    let rule = read_yaml(manifest)?;
    let groups = rule["spec"]["groups"].as_array().with_context(|| format!("{} has no spec.groups", manifest.display()))?;
    let mut names = Vec::new();
    for group in groups {
        for rule in group["rules"].as_array().into_iter().flatten() {
            if let Some(name) = rule["alert"].as_str() {
                names.push(name.to_string());
            }
        }
    }
    Ok(names)
}

/// The job name Prometheus gives the agents' targets: the Prometheus Operator names a
/// ServiceMonitor's job after the Service it selects (`vramguard-agent`, the only one with
/// the selector's label), which the alert rules' `up{job=...}` rely on.
pub const JOB: &str = "vramguard-agent";

/// The labels the Prometheus Operator's relabelings give every target of the ServiceMonitor
/// (the agent's own pod: namespace, pod, container, service, endpoint), for a static target.
pub const AGENT_POD_LABELS: [(&str, &str); 5] = [
    ("namespace", "vramguard-system"),
    ("pod", "vramguard-agent-e2e"),
    ("container", "vramguard"),
    ("service", "vramguard-agent"),
    ("endpoint", "metrics"),
];

/// A Prometheus configuration equivalent to the ServiceMonitor at `manifest` for one agent
/// at `target` (static, where Kubernetes would discover the endpoints): its endpoint's
/// interval, path and `honorLabels`, the job named as the operator names it ([`JOB`]), the
/// target labels the operator's relabelings add ([`AGENT_POD_LABELS`]), and `rule_files`.
pub fn scrape_config(manifest: &Path, target: SocketAddr, rule_files: &[&Path]) -> Result<String> {
    let monitor = read_yaml(manifest)?;
    ensure!(monitor["kind"] == "ServiceMonitor", "{} is not a ServiceMonitor", manifest.display());
    let endpoints = monitor["spec"]["endpoints"].as_array().with_context(|| format!("{} has no endpoints", manifest.display()))?;
    let [endpoint] = &endpoints[..] else {
        bail!("{} has {} endpoints; the test knows one", manifest.display(), endpoints.len());
    };
    for key in endpoint.as_object().into_iter().flatten().map(|(k, _)| k) {
        ensure!(
            ["port", "path", "interval", "honorLabels"].contains(&key.as_str()),
            "the ServiceMonitor's endpoint has `{key}`, which the test's equivalent scrape configuration does not carry"
        );
    }
    let interval = endpoint["interval"].as_str().context("the endpoint has no interval")?;
    let labels: serde_json::Map<String, Value> = AGENT_POD_LABELS.iter().map(|(k, v)| (k.to_string(), json!(v))).collect();
    let config = json!({
        "global": { "scrape_interval": interval, "evaluation_interval": interval },
        "rule_files": rule_files.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
        "scrape_configs": [{
            "job_name": JOB,
            "scrape_interval": interval,
            "metrics_path": endpoint["path"].as_str().unwrap_or("/metrics"),
            "honor_labels": endpoint["honorLabels"].as_bool().unwrap_or(false),
            "static_configs": [{ "targets": [target.to_string()], "labels": labels }],
        }],
    });
    Ok(serde_json::to_string_pretty(&config)?)
}

/// A running Prometheus of its own.
pub struct Prometheus {
    child: Child,
    addr: SocketAddr,
    dir: TempDir,
}

impl Prometheus {
    /// Starts the cached `prometheus` with the configuration `config` (written to its
    /// directory as `prometheus.yml`, beside `files` written as they are: rule files) and
    /// waits until it is ready.
    pub fn start(config: &str, files: &[(&str, &str)]) -> Result<Prometheus> {
        let cache = cache()?;
        let dir = TempDir::new("prometheus")?;
        for (name, text) in files {
            std::fs::write(dir.path().join(name), text)?;
        }
        let config_path = dir.path().join("prometheus.yml");
        std::fs::write(&config_path, config)?;
        // A free port: bound and released (nothing else here races for it within a moment).
        let addr = TcpListener::bind("127.0.0.1:0")?.local_addr()?;
        let log = std::fs::File::create(dir.path().join("prometheus.log"))?;
        let child = Command::new(cache.bin("prometheus"))
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
            .arg(format!("--web.listen-address={addr}"))
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("cannot start prometheus")?;
        let mut prometheus = Prometheus { child, addr, dir };
        wait_for(Duration::from_secs(30), "prometheus ready", || {
            if let Some(status) = prometheus.child.try_wait()? {
                bail!("prometheus exited ({status}): {}", prometheus.log());
            }
            Ok(prometheus.get("/-/ready").is_ok_and(|(status, _)| status == 200))
        })?;
        Ok(prometheus)
    }

    /// Its HTTP address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// `GET path` over HTTP/1.0 (the answer is then never chunked): (status, body).
    pub fn get(&self, path: &str) -> Result<(u16, String)> {
        let request = format!("GET {path} HTTP/1.0\r\nHost: {}\r\n\r\n", self.addr);
        let answer = crate::http::raw(self.addr, request.as_bytes())?;
        let text = String::from_utf8(answer).context("prometheus answered non-UTF-8")?;
        let (head, body) = text.split_once("\r\n\r\n").ok_or_else(|| anyhow!("no end of head in {text:?}"))?;
        let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).ok_or_else(|| anyhow!("bad status line in {head:?}"))?;
        Ok((status, body.to_string()))
    }

    /// `GET` an API path (`/api/v1/...`) and its `data`; fails unless the status is success.
    pub fn api(&self, path: &str) -> Result<Value> {
        let (status, body) = self.get(path)?;
        let answer: Value = serde_json::from_str(&body).with_context(|| format!("GET {path}: {status} {body}"))?;
        ensure!(status == 200 && answer["status"] == "success", "GET {path}: {status} {body}");
        Ok(answer["data"].clone())
    }

    /// The instant vector `expr` evaluates to now: its series (`metric` labels and `value`).
    pub fn query(&self, expr: &str) -> Result<Vec<Value>> {
        let data = self.api(&format!("/api/v1/query?query={}", encode(expr)))?;
        ensure!(data["resultType"] == "vector", "{expr} is a {}, not an instant vector", data["resultType"]);
        Ok(data["result"].as_array().cloned().unwrap_or_default())
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `text` percent-encoded for a URL's query.
fn encode(text: &str) -> String {
    let mut out = String::new();
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-_.~".contains(&byte) {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}
