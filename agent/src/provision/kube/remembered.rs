//! The pod cache's last state on disk, `<state-dir>/pods.json` ([`REMEMBERED`]): what the node
//! knows of its pods' quotas when the API server cannot answer (a restart of the agent while
//! it is down included). Written by the cache's watch whenever what it keeps of the node's
//! pods changes (a pod added or removed, a list that differs), never for status updates; read
//! once at start. Only the agent writes the state directory, so the file is trusted as the
//! agent's own; it is bounded ([`MAX_BYTES`]) and a file of another node, or one that does not
//! decode, is ignored (logged). A pod is known by its UID: a pod of the same name with another
//! UID is another pod, and the limits of a pod UID never change.
use std::{
    collections::{BTreeMap, HashMap},
    io::Read as _,
    path::Path,
};

use serde::{Deserialize, Serialize};

use super::objects::PodQuotas;

/// The file's name in the state directory.
pub const REMEMBERED: &str = "pods.json";

/// The most bytes read from it (a node's pods take a few kilobytes).
pub const MAX_BYTES: u64 = 16 << 20;

pub(super) type Key = (String, String);

#[derive(Serialize, Deserialize)]
struct Remembered {
    node: String,
    pods: Vec<Pod>,
}

#[derive(Serialize, Deserialize)]
struct Pod {
    namespace: String,
    name: String,
    uid: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    mirror_of: Option<String>,
    containers: BTreeMap<String, Limit>,
}

/// A container's limit as written.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Limit {
    Quota(u64),
    NoQuota,
    /// Not a whole number of bytes (the text).
    Invalid(String),
}

/// The file's bytes for the pods of `node`.
pub(super) fn encode(node: &str, pods: &HashMap<Key, PodQuotas>) -> Vec<u8> {
    let mut list: Vec<Pod> = pods
        .iter()
        .map(|((namespace, name), quotas)| Pod {
            namespace: namespace.clone(),
            name: name.clone(),
            uid: quotas.uid.clone(),
            mirror_of: quotas.mirror_of.clone(),
            containers: quotas
                .containers
                .iter()
                .map(|(name, limit)| {
                    let limit = match limit {
                        Ok(Some(bytes)) => Limit::Quota(*bytes),
                        Ok(None) => Limit::NoQuota,
                        Err(text) => Limit::Invalid(text.clone()),
                    };
                    (name.clone(), limit)
                })
                .collect(),
        })
        .collect();
    list.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    serde_json::to_vec(&Remembered { node: node.to_owned(), pods: list }).unwrap_or_default()
}

/// The pods of `node` in the file at `path` (none if there is no file).
pub(super) fn load(path: &Path, node: &str) -> Result<HashMap<Key, PodQuotas>, String> {
    let file = match std::fs::File::open(path) {
        Ok(file) => file,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(HashMap::new()),
        Err(error) => return Err(format!("cannot open {}: {error}", path.display())),
    };
    let mut bytes = Vec::new();
    file.take(MAX_BYTES + 1).read_to_end(&mut bytes).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if bytes.len() as u64 > MAX_BYTES {
        return Err(format!("{} is larger than {MAX_BYTES} bytes", path.display()));
    }
    let remembered: Remembered = serde_json::from_slice(&bytes).map_err(|e| format!("{} does not decode: {e}", path.display()))?;
    if remembered.node != node {
        return Err(format!("{} is node {:?}'s, this is {node:?}", path.display(), remembered.node));
    }
    Ok(remembered
        .pods
        .into_iter()
        .map(|pod| {
            let containers = pod
                .containers
                .into_iter()
                .map(|(name, limit)| {
                    let limit = match limit {
                        Limit::Quota(bytes) => Ok(Some(bytes)),
                        Limit::NoQuota => Ok(None),
                        Limit::Invalid(text) => Err(text),
                    };
                    (name, limit)
                })
                .collect();
            ((pod.namespace, pod.name), PodQuotas { uid: pod.uid, mirror_of: pod.mirror_of, containers })
        })
        .collect())
}

/// Writes `bytes` to `path` (mode 0600) through a temporary file renamed into place.
pub(super) fn write(path: &Path, bytes: &[u8]) -> Result<(), String> {
    crate::provision::store::write_new(path, bytes, 0o600)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_and_read_back_for_its_node_only() {
        let dir = std::env::temp_dir().join(format!("vramguard-remembered-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let path = dir.join(REMEMBERED);
        let mut pods = HashMap::new();
        let containers = HashMap::from([
            ("main".to_string(), Ok(Some(1 << 30))),
            ("side".to_string(), Ok(None)),
            ("odd".to_string(), Err("1500m".to_string())),
        ]);
        pods.insert(("team-a".into(), "trainer".into()), PodQuotas { uid: "u1".into(), mirror_of: Some("s1".into()), containers });
        assert_eq!(load(&path, "n1"), Ok(HashMap::new()), "no file: nothing known");
        write(&path, &encode("n1", &pods)).expect("write");
        assert_eq!(load(&path, "n1"), Ok(pods));
        assert!(load(&path, "n2").expect_err("another node's").contains("n1"));
        std::fs::write(&path, b"{").expect("garbage");
        assert!(load(&path, "n1").is_err());
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
