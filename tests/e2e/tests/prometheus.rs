//! The agent as a real Prometheus sees it (issue 19, "Monitoring that is tested against the
//! real thing"): Debian's Prometheus (from `cargo xtask setup`'s cache) scrapes the agent with
//! a configuration equivalent to `deploy/kubernetes/servicemonitor.yaml` (its interval, path
//! and `honorLabels`, the job and target labels the Prometheus Operator gives, a static target
//! where Kubernetes would discover it) and the alert rules of `prometheusrule.yaml`, during a
//! run like the demo's second scene: a private containerd with NRI, the agent provisioning
//! namespace team-a from a quota file, pod team-a/trainer (provisioned, hooked) and pod
//! team-b/web (not provisioned: its process is un-hooked), and an allocation past the quota
//! refused in trainer. Through Prometheus's HTTP API the test checks that the per-container
//! usage, limit and rejection series carry the workload's pod labels (not the agent pod's that
//! the target labels would give), that web has none, that the rules load and evaluate (the
//! rejection alert fires for trainer), and that every query of the Grafana dashboard
//! `deploy/grafana/vramguard.json` returns series.
//!
//! Needs root, the containerd and Prometheus caches (`cargo xtask setup`) and the built
//! binaries; takes about a minute (two or three scrapes at the manifest's 15 s).
use std::{
    collections::BTreeMap,
    ffi::{OsStr, OsString},
    path::Path,
    time::Duration,
};

use anyhow::{ensure, Context, Result};
use e2e::{
    agent::{provisioning_args, Agent},
    containerd::{workload_path, ContainerSpec, Containerd},
    prometheus::{read_yaml, repo_root, rules_file, scrape_config, Prometheus, AGENT_POD_LABELS, JOB},
    timeout, wait_for, FakeNode, TempDir, GIB,
};
use serde_json::Value;

/// The quota of namespace team-a (the demo's: trainer's context and 256 MiB, then another
/// context and 256 MiB fit; 1 GiB more does not).
const QUOTA: u64 = 2 * GIB;
/// How long the test waits for Prometheus: a few scrapes and rule evaluations at 15 s.
const SCRAPES: Duration = Duration::from_secs(90);
/// The pod labels the agent's per-container series must carry for trainer.
const TRAINER: [(&str, &str); 3] = [("namespace", "team-a"), ("pod", "trainer"), ("container", "main")];
/// What Grafana's variables stand for when the test runs the dashboard's queries: every
/// namespace, and a rate window of 5 minutes (Grafana's `$__rate_interval` is at least four
/// scrape intervals; the run's samples all fall within 5 minutes).
const VARIABLES: [(&str, &str); 2] = [("$namespace", ".*"), ("$__rate_interval", "5m")];

/// `name{labels}` as a PromQL selector.
fn selector(name: &str, labels: &[(&str, &str)]) -> String {
    let matchers: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v:?}")).collect();
    format!("{name}{{{}}}", matchers.join(","))
}

/// A series' value as a number (Prometheus sends `[time, "value"]`).
fn value(series: &Value) -> Option<f64> {
    series["value"][1].as_str()?.parse().ok()
}

/// Every `expr` of the dashboard's panels (rows hold panels too), with the panel's title.
fn dashboard_queries(dashboard: &Value) -> Vec<(String, String)> {
    let mut queries = Vec::new();
    let mut panels: Vec<&Value> = dashboard["panels"].as_array().into_iter().flatten().collect();
    while let Some(panel) = panels.pop() {
        panels.extend(panel["panels"].as_array().into_iter().flatten());
        for target in panel["targets"].as_array().into_iter().flatten() {
            if let Some(expr) = target["expr"].as_str() {
                queries.push((panel["title"].as_str().unwrap_or("?").to_string(), expr.to_string()));
            }
        }
    }
    queries
}

#[test]
fn prometheus_scrapes_the_agents_series_with_pod_labels_and_every_dashboard_query_returns_series() -> Result<()> {
    // The node: a fake 8 GiB GPU, containerd with NRI, the agent provisioning team-a (with the
    // fake's NVML: the driver view's series exist too).
    let dir = TempDir::new("prometheus")?;
    let path = |name: &str| dir.path().join(name);
    let fake = FakeNode::new("prometheus").with_env("FAKECUDA_DEVICE_BYTES", "8g").with_env("FAKECUDA_CONTEXT_BYTES", "518m");
    std::fs::create_dir_all(path("ledgers"))?;
    std::fs::write(path("quotas"), "namespace=team-a 2g\n")?;
    let containerd = Containerd::start(&path("nri.sock"))?;
    let libcuda = e2e::fake_driver_dir()?.join("libcuda.so.1");
    let provisioning = provisioning_args(&path("nri.sock"), &path("state"), &path("quotas"), "8g")?;
    let ledgers = path("ledgers");
    let mut args: Vec<&OsStr> = vec![
        OsStr::new("--libcuda"),
        libcuda.as_os_str(),
        OsStr::new("--no-discover"),
        OsStr::new("--ledger-dir"),
        ledgers.as_os_str(),
        OsStr::new("--metrics-addr"),
        OsStr::new("127.0.0.1:0"),
    ];
    args.extend(provisioning.iter().map(OsString::as_os_str));
    let agent = Agent::start_with_env(&args, fake.env())?;
    wait_for(timeout(), "the agent registered with containerd", || Ok(agent.audit()?["nri_connected"] == true))
        .with_context(|| agent.log())?;

    // Two pods holding GPU memory, as in the demo: trainer provisioned, web not.
    let mut pids = BTreeMap::new();
    for (name, namespace, uid, holds) in [
        ("trainer", "team-a", "prom-trainer", ["ctx 0", "alloc weights 256m", "hold"]),
        ("web", "team-b", "prom-web", ["ctx 0", "alloc scratch 2g", "hold"]),
    ] {
        let pod = containerd.pod(name, namespace, uid, &[])?;
        let command: Vec<String> = [workload_path()].into_iter().chain(holds.iter().map(|s| s.to_string())).collect();
        let id = containerd.run_container(&pod, &ContainerSpec::new("main").command(command).fake_driver(&fake)?)?;
        pids.insert(name, (id.clone(), containerd.container_pid(&id)?));
    }
    let (trainer, trainer_pid) = pids["trainer"].clone();
    let (_, web_pid) = pids["web"].clone();
    wait_for(timeout(), "trainer's workload ok and web's unhooked in the agent's audit", || {
        let audit = agent.audit()?;
        let state = |pid: u32| {
            audit["processes"].as_array().into_iter().flatten().find(|r| r["pid"] == pid).and_then(|r| r["state"].as_str().map(str::to_owned))
        };
        Ok(state(trainer_pid).as_deref() == Some("ok") && state(web_pid).as_deref() == Some("unhooked"))
    })
    .with_context(|| agent.log())?;

    // Prometheus, configured from the manifests, scraping the agent.
    let deploy = repo_root().join("deploy/kubernetes");
    let rules = rules_file(&deploy.join("prometheusrule.yaml"))?;
    let config = scrape_config(&deploy.join("servicemonitor.yaml"), agent.metrics_addr()?, &[Path::new("rules.yaml")])?;
    let prometheus = Prometheus::start(&config, &[("rules.yaml", &rules)])?;
    eprintln!("prometheus on {} with:\n{config}", prometheus.addr());
    wait_for(SCRAPES, "Prometheus's first scrape of the agent", || Ok(!prometheus.query(&format!("up{{job={JOB:?}}} == 1"))?.is_empty()))
        .with_context(|| format!("prometheus's log:\n{}", prometheus.log()))?;

    // After that first scrape: an allocation past trainer's quota, refused (a rejection), by a
    // process then SIGKILLed holding memory (its ledger slot reclaimed by the agent).
    let steps = [workload_path().as_str(), "ctx 0", "alloc a 256m", "expect-oom alloc b 1g", "kill"].map(str::to_owned);
    let steps: Vec<&str> = steps.iter().map(String::as_str).collect();
    let out = containerd.exec_sync(&trainer, &steps)?;
    ensure!(out.exit_code != 0 && out.stdout.lines().any(|l| l == "oom b"), "the allocation past the quota must be refused: {out:?}");
    // (Any ledger's: which labels it carries is checked below, with the series in the message.)
    let rejected = "increase(vramguard_container_rejections_total[5m]) > 0";
    let took = wait_for(SCRAPES, "the rejection in Prometheus", || Ok(!prometheus.query(rejected)?.is_empty()))
        .with_context(|| format!("prometheus's log:\n{}", prometheus.log()))?;
    eprintln!("the rejection reached Prometheus {took:?} after the workload's refusal");
    wait_for(SCRAPES, "the reclaim in Prometheus", || Ok(!prometheus.query("increase(vramguard_reclaims_total[5m]) > 0")?.is_empty()))?;

    // The per-container usage, limit and rejection series carry trainer's pod labels.
    for family in ["vramguard_container_memory_used_bytes", "vramguard_container_memory_limit_bytes", "vramguard_container_rejections_total"] {
        let series = prometheus.query(&selector(family, &TRAINER))?;
        ensure!(!series.is_empty(), "no {family} series with trainer's labels: {:?}", prometheus.query(family)?);
        for one in &series {
            ensure!(one["metric"]["job"] == JOB && one["metric"]["ledger"].as_str().is_some_and(|l| !l.is_empty()), "{family}: {one}");
        }
        // Negative control: web's container was not provisioned, so it has no ledger and no
        // series; and none of the family carries the agent pod's own name (honorLabels).
        ensure!(prometheus.query(&selector(family, &[("pod", "web")]))?.is_empty(), "{family} has a series for web");
        let agent_pod = AGENT_POD_LABELS.iter().find(|(k, _)| *k == "pod").map(|(_, v)| *v).context("pod label")?;
        ensure!(prometheus.query(&selector(family, &[("pod", agent_pod)]))?.is_empty(), "{family} took the agent pod's name");
    }
    let limit = prometheus.query(&selector("vramguard_container_memory_limit_bytes", &TRAINER))?;
    ensure!(limit.iter().all(|s| value(s) == Some(QUOTA as f64)), "trainer's limit is its quota: {limit:?}");
    let used = prometheus.query(&format!("sum({})", selector("vramguard_container_memory_used_bytes", &TRAINER)))?;
    ensure!(used.first().and_then(value).is_some_and(|bytes| bytes >= (256u64 << 20) as f64), "trainer holds 256 MiB and a context: {used:?}");
    let rejections = prometheus.query(&selector("vramguard_container_rejections_total", &TRAINER))?;
    ensure!(rejections.iter().any(|s| value(s) >= Some(1.0)), "trainer's refusal counted: {rejections:?}");

    // The rules loaded and evaluate; the rejection alert fires for trainer, not for web.
    let groups = prometheus.api("/api/v1/rules")?;
    let mut rules_seen = 0;
    for group in groups["groups"].as_array().into_iter().flatten() {
        for rule in group["rules"].as_array().into_iter().flatten() {
            ensure!(rule["health"] != "err", "rule {} does not evaluate: {}", rule["name"], rule["lastError"]);
            rules_seen += 1;
        }
    }
    ensure!(rules_seen == e2e::prometheus::alert_names(&deploy.join("prometheusrule.yaml"))?.len(), "Prometheus loaded {rules_seen} rules");
    let firing = "ALERTS{alertname=\"VramguardContainerRejections\",alertstate=\"firing\",pod=\"trainer\",namespace=\"team-a\"}";
    wait_for(SCRAPES, "VramguardContainerRejections firing for trainer", || Ok(!prometheus.query(firing)?.is_empty()))?;
    ensure!(prometheus.query("ALERTS{alertname=\"VramguardContainerRejections\",pod=\"web\"}")?.is_empty(), "an alert for web");

    // Every query of the dashboard returns series with a number.
    let dashboard = read_yaml(&repo_root().join("deploy/grafana/vramguard.json"))?;
    let queries = dashboard_queries(&dashboard);
    ensure!(queries.len() >= 10, "the dashboard has {} queries", queries.len());
    let mut empty = Vec::new();
    for (title, expr) in &queries {
        let expr = VARIABLES.iter().fold(expr.clone(), |e, (name, value)| e.replace(name, value));
        ensure!(!expr.contains('$'), "panel {title:?}: a variable the test does not know in {expr}");
        let series = prometheus.query(&expr).with_context(|| format!("panel {title:?}"))?;
        let numbers = series.iter().filter(|s| value(s).is_some_and(f64::is_finite)).count();
        eprintln!("{title}: {expr}: {} series ({numbers} with a number)", series.len());
        if numbers == 0 {
            empty.push(format!("{title}: {expr} ({series:?})"));
        }
    }
    ensure!(empty.is_empty(), "dashboard queries without data:\n{}", empty.join("\n"));

    drop(prometheus);
    agent.stop().context("the agent did not stop cleanly")?;
    drop(containerd);
    fake.cleanup();
    Ok(())
}
