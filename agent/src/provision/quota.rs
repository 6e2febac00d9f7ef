//! Where a container's quota comes from when the pod spec cannot say (nodes without
//! Kubernetes, tests): the operator's quota file, and, behind an explicit admin flag, a pod
//! annotation. The Kubernetes source is [`super::kube`].
//!
//! # The quota file (`--quota-file`)
//!
//! One rule a line: selectors, all of which must match, then the quota on each GPU the
//! container sees (bytes, or k/m/g/t, 1024-based; `0`: no quota, the container is not
//! provisioned). The first rule that matches wins; `*` in a selector's value matches any run
//! of characters.
//!
//! ```text
//! # selectors                                   quota per GPU
//! namespace=team-a pod=trainer-* container=main   8g
//! pod-uid=6b1c2d0e-0000-4000-8000-000000000001    2g
//! cgroup=/k8s.io/*                                1g
//! ```
//!
//! The file is read again when a container is created; a file that became invalid is logged
//! and the rules read before stay in force.
//!
//! # The annotation (`--quota-from-annotation`)
//!
//! `vramguard.io/gpu-memory.<container>` (one container) or `vramguard.io/gpu-memory` (every
//! container of the pod) on the pod. Whoever creates pods then sets quotas: for nodes where
//! that is the operator (the flag says so), never for multi-tenant clusters.
use std::{
    path::{Path, PathBuf},
    sync::Mutex,
};

use crate::glob::matches;

/// The annotation read under `--quota-from-annotation`.
pub const ANNOTATION: &str = "vramguard.io/gpu-memory";

/// What a rule can select on: the container as the runtime describes it.
#[derive(Clone, Debug, Default)]
pub struct Subject<'a> {
    pub namespace: &'a str,
    pub pod: &'a str,
    pub pod_uid: &'a str,
    pub container: &'a str,
    /// The container's cgroup, relative to the cgroup2 root (empty if unknown).
    pub cgroup: &'a str,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Field {
    Namespace,
    Pod,
    PodUid,
    Container,
    Cgroup,
}

/// One line of a quota file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuotaRule {
    selectors: Vec<(Field, String)>,
    /// Bytes per GPU; 0: not provisioned.
    pub quota: u64,
}

impl QuotaRule {
    fn selects(&self, subject: &Subject) -> bool {
        self.selectors.iter().all(|(field, pattern)| {
            let value = match field {
                Field::Namespace => subject.namespace,
                Field::Pod => subject.pod,
                Field::PodUid => subject.pod_uid,
                Field::Container => subject.container,
                Field::Cgroup => subject.cgroup,
            };
            matches(pattern, value)
        })
    }
}

/// Parses a quota file's text; the error names the line.
pub fn parse_quota_rules(text: &str) -> Result<Vec<QuotaRule>, String> {
    let mut rules = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let at = |what: String| format!("line {}: {what}", number + 1);
        let fields: Vec<&str> = line.split_whitespace().collect();
        let Some((quota, selectors)) = fields.split_last().filter(|(_, selectors)| !selectors.is_empty()) else {
            return Err(at(format!("expected `SELECTOR=VALUE ... QUOTA`, found {line:?}")));
        };
        let quota = cuda_abi::parse_size(quota).ok_or_else(|| at(format!("{quota:?} is not a size (bytes, or a number with k, m, g or t)")))?;
        let mut parsed = Vec::new();
        for selector in selectors {
            let (key, value) = selector.split_once('=').ok_or_else(|| at(format!("{selector:?} is not SELECTOR=VALUE")))?;
            let field = match key {
                "namespace" => Field::Namespace,
                "pod" => Field::Pod,
                "pod-uid" => Field::PodUid,
                "container" => Field::Container,
                "cgroup" => Field::Cgroup,
                other => return Err(at(format!("unknown selector {other:?} (namespace, pod, pod-uid, container, cgroup)"))),
            };
            parsed.push((field, value.to_string()));
        }
        rules.push(QuotaRule { selectors: parsed, quota });
    }
    Ok(rules)
}

/// The operator's quota file, re-read on use.
pub struct QuotaFile {
    path: PathBuf,
    /// The text the rules were parsed from, and the rules.
    last: Mutex<(String, Vec<QuotaRule>)>,
}

impl QuotaFile {
    /// Reads and parses `path`; an error at start is fatal (the operator gave a broken file).
    pub fn open(path: &Path) -> Result<QuotaFile, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read the quota file {}: {e}", path.display()))?;
        let rules = parse_quota_rules(&text).map_err(|e| format!("in the quota file {}: {e}", path.display()))?;
        Ok(QuotaFile { path: path.to_path_buf(), last: Mutex::new((text, rules)) })
    }

    /// The quota of the first rule selecting `subject`, if one does (`Some(0)`: a rule says
    /// no quota).
    pub fn quota(&self, subject: &Subject) -> Option<u64> {
        let Ok(mut last) = self.last.lock() else { return None };
        match std::fs::read_to_string(&self.path) {
            Ok(text) if text != last.0 => match parse_quota_rules(&text) {
                Ok(rules) => {
                    tracing::info!(file = %self.path.display(), rules = rules.len(), "quota file changed: new rules in force");
                    *last = (text, rules);
                }
                Err(error) => {
                    tracing::warn!(file = %self.path.display(), %error, "the changed quota file is invalid: the rules read before stay in force");
                    last.0 = text;
                }
            },
            Ok(_) => {}
            Err(error) => tracing::warn!(file = %self.path.display(), %error, "cannot re-read the quota file: the rules read before stay in force"),
        }
        last.1.iter().find(|rule| rule.selects(subject)).map(|rule| rule.quota)
    }
}

/// The quota the pod's annotations give `container` (see the module doc), or why they give
/// none that can be used.
pub fn from_annotations<'a>(
    annotations: impl IntoIterator<Item = (&'a String, &'a String)> + Clone,
    container: &str,
) -> Result<Option<u64>, String> {
    let specific = format!("{ANNOTATION}.{container}");
    let find = |key: &str| annotations.clone().into_iter().find(|(k, _)| k.as_str() == key).map(|(_, v)| v.clone());
    let Some((key, value)) = find(&specific).map(|v| (specific.clone(), v)).or_else(|| find(ANNOTATION).map(|v| (ANNOTATION.to_string(), v)))
    else {
        return Ok(None);
    };
    super::parse_quota(value.trim()).map(Some).ok_or_else(|| format!("annotation {key}={value:?} is not a quantity"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn subject<'a>(namespace: &'a str, pod: &'a str, container: &'a str) -> Subject<'a> {
        Subject { namespace, pod, pod_uid: "uid-9", container, cgroup: "/k8s.io/c9" }
    }

    #[test]
    fn rules_select_and_the_first_wins() {
        let rules = parse_quota_rules(
            "# comment\nnamespace=team-a pod=trainer-* container=main 8g\npod-uid=uid-9 2g # by uid\ncgroup=/k8s.io/* 0\n",
        )
        .expect("rules");
        let first = |s: &Subject| rules.iter().find(|r| r.selects(s)).map(|r| r.quota);
        assert_eq!(first(&subject("team-a", "trainer-0", "main")), Some(8 << 30));
        assert_eq!(first(&subject("team-a", "trainer-0", "sidecar")), Some(2 << 30));
        let other = Subject { pod_uid: "uid-1", ..subject("team-b", "x", "y") };
        assert_eq!(first(&other), Some(0));
        let nowhere = Subject { cgroup: "/elsewhere", ..other };
        assert_eq!(first(&nowhere), None);
    }

    #[test]
    fn bad_rules_name_their_line() {
        for (text, says) in [
            ("8g", "expected"),
            ("pod=a lots", "not a size"),
            ("pod 1g", "not SELECTOR=VALUE"),
            ("\nnode=a 1g", "line 2: unknown selector"),
        ] {
            let error = parse_quota_rules(text).expect_err(text);
            assert!(error.contains(says), "{text:?}: {error}");
        }
    }

    #[test]
    fn the_file_is_reread_and_a_broken_version_keeps_the_old_rules() {
        let path = std::env::temp_dir().join(format!("vramguard-quota-{}", std::process::id()));
        std::fs::write(&path, "pod=a 1g\n").expect("write");
        let file = QuotaFile::open(&path).expect("open");
        let a = subject("ns", "a", "c");
        assert_eq!(file.quota(&a), Some(1 << 30));
        std::fs::write(&path, "pod=a 3g\n").expect("write");
        assert_eq!(file.quota(&a), Some(3 << 30));
        std::fs::write(&path, "pod=a three\n").expect("write");
        assert_eq!(file.quota(&a), Some(3 << 30), "broken: the rules before");
        std::fs::remove_file(&path).expect("rm");
        assert_eq!(file.quota(&a), Some(3 << 30), "gone: the rules before");
        assert!(QuotaFile::open(&path).is_err());
    }

    #[test]
    fn annotations() {
        let mut annotations = BTreeMap::new();
        assert_eq!(from_annotations(&annotations, "main"), Ok(None));
        annotations.insert(ANNOTATION.to_string(), "2Gi".to_string());
        assert_eq!(from_annotations(&annotations, "main"), Ok(Some(2 << 30)));
        annotations.insert(format!("{ANNOTATION}.main"), "512Mi".to_string());
        assert_eq!(from_annotations(&annotations, "main"), Ok(Some(512 << 20)));
        assert_eq!(from_annotations(&annotations, "other"), Ok(Some(2 << 30)));
        annotations.insert(ANNOTATION.to_string(), "plenty".to_string());
        assert!(from_annotations(&annotations, "other").expect_err("bad").contains("plenty"));
    }
}
