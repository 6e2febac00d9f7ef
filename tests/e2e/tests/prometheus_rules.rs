//! The alert rules as Prometheus itself evaluates them (issue 19, "Monitoring that is tested
//! against the real thing"): the rule groups of `deploy/kubernetes/prometheusrule.yaml`, taken
//! from the manifest (not re-typed) into a plain rules file, pass `promtool check rules`, and
//! `promtool test rules` runs the unit tests in `deploy/monitoring/tests/*.yaml` over them. Every
//! alert of the manifest must have a case where it fires and one where it stays quiet.
//!
//! Needs the Prometheus cache (`cargo xtask setup`); runs no agent and needs no root.
use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{ensure, Context, Result};
use e2e::{
    prometheus::{alert_names, cache, read_yaml, repo_root, rules_file},
    TempDir,
};

fn manifest() -> PathBuf {
    repo_root().join("deploy/kubernetes/prometheusrule.yaml")
}

/// The unit test files, sorted.
fn test_files() -> Result<Vec<PathBuf>> {
    let dir = repo_root().join("deploy/monitoring/tests");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .with_context(|| format!("cannot read {}", dir.display()))?
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    ensure!(!files.is_empty(), "no unit tests in {}", dir.display());
    Ok(files)
}

/// `promtool <args>` in `dir`; its output, or an error with it.
fn promtool(dir: &Path, args: &[&str]) -> Result<String> {
    let out = Command::new(cache()?.bin("promtool")).args(args).current_dir(dir).output().context("cannot run promtool")?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    ensure!(out.status.success(), "promtool {args:?} failed ({}):\n{text}", out.status);
    Ok(text)
}

#[test]
fn every_alert_fires_on_its_condition_and_stays_quiet_without_it() -> Result<()> {
    let dir = TempDir::new("promtool")?;
    std::fs::write(dir.path().join("rules.yaml"), rules_file(&manifest())?)?;
    let checked = promtool(dir.path(), &["check", "rules", "rules.yaml"])?;
    eprintln!("{checked}");

    let mut names = Vec::new();
    let mut fires = BTreeSet::new();
    let mut quiet = BTreeSet::new();
    for file in test_files()? {
        let tests = read_yaml(&file)?;
        ensure!(
            tests["rule_files"] == serde_json::json!(["rules.yaml"]),
            "{} must test rules.yaml (the manifest's rules) and nothing else: rule_files is {}",
            file.display(),
            tests["rule_files"]
        );
        for case in tests["tests"].as_array().into_iter().flatten() {
            for check in case["alert_rule_test"].as_array().into_iter().flatten() {
                let alert = check["alertname"].as_str().with_context(|| format!("{}: a test without alertname", file.display()))?;
                let expected = check["exp_alerts"].as_array().map_or(0, Vec::len);
                if expected > 0 { &mut fires } else { &mut quiet }.insert(alert.to_string());
            }
        }
        let name = file.file_name().context("file name")?.to_string_lossy().into_owned();
        std::fs::copy(&file, dir.path().join(&name))?;
        names.push(name);
    }

    let alerts = alert_names(&manifest())?;
    ensure!(!alerts.is_empty(), "no alerts in {}", manifest().display());
    let untested: Vec<&String> = alerts.iter().filter(|a| !fires.contains(*a) || !quiet.contains(*a)).collect();
    let unknown: Vec<&String> = fires.union(&quiet).filter(|a| !alerts.contains(a)).collect();
    ensure!(
        untested.is_empty() && unknown.is_empty(),
        "every alert needs a unit test where it fires and one where it stays quiet: without both: {untested:?}; \
         tested but not in the manifest: {unknown:?}"
    );

    let args: Vec<&str> = ["test", "rules"].into_iter().chain(names.iter().map(String::as_str)).collect();
    let out = promtool(dir.path(), &args)?;
    eprintln!("{out}");
    ensure!(out.matches("SUCCESS").count() == names.len(), "promtool did not report every file a success:\n{out}");
    eprintln!("{} alerts, each firing and quiet in {} unit test files", alerts.len(), names.len());
    Ok(())
}
