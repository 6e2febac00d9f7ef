//! The prepared claims, kept in `<state-dir>/dra/checkpoint.json`: written (atomically, synced)
//! before prepare answers the kubelet and after unprepare forgets a claim, read at start so
//! that a restarted agent answers a repeated prepare with the same devices and unprepares what
//! it prepared, even after the claim is gone from the API server.
//!
//! The file is the agent's own (0600 in a 0700 directory); one it cannot read or parse is an
//! error at start, never an empty book: forgetting a prepared claim would leave its CDI spec and
//! its quota behind.
use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::Prepared;

/// The on-disk format's version; another one is refused with its number.
const VERSION: u32 = 1;

#[derive(Serialize, Deserialize)]
struct OnDisk {
    version: u32,
    /// The prepared claims by UID.
    claims: BTreeMap<String, Prepared>,
}

/// The prepared claims and the file that keeps them.
#[derive(Debug)]
pub struct Checkpoint {
    path: PathBuf,
    claims: BTreeMap<String, Prepared>,
}

impl Checkpoint {
    /// The checkpoint under `state_dir` (`<state-dir>/dra/checkpoint.json`): what it holds, or
    /// empty when there is no file yet.
    pub fn open(state_dir: &Path) -> Result<Checkpoint, String> {
        let path = state_dir.join("dra").join("checkpoint.json");
        let claims = match fs::read(&path) {
            Ok(bytes) => {
                let on_disk: OnDisk = serde_json::from_slice(&bytes).map_err(|e| format!("the DRA checkpoint {} is not valid: {e}", path.display()))?;
                if on_disk.version != VERSION {
                    return Err(format!("the DRA checkpoint {} has version {}, this agent reads {VERSION}", path.display(), on_disk.version));
                }
                on_disk.claims
            }
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(error) => return Err(format!("cannot read the DRA checkpoint {}: {error}", path.display())),
        };
        Ok(Checkpoint { path, claims })
    }

    /// [`Checkpoint::open`] for the driver that writes it, once at its start: the directory
    /// made the agent's alone first (0700), whoever made it (the claims' directories below it
    /// are mounted into containers by the runtime, which is root). Readers (the NRI side) use
    /// `open`, which changes nothing.
    pub fn own(state_dir: &Path) -> Result<Checkpoint, String> {
        let dir = state_dir.join("dra");
        fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).map_err(|e| format!("cannot make {} the agent's alone: {e}", dir.display()))?;
        Checkpoint::open(state_dir)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The prepared claim with this UID.
    pub fn get(&self, uid: &str) -> Option<&Prepared> {
        self.claims.get(uid)
    }

    /// Every prepared claim, by UID.
    pub fn claims(&self) -> impl Iterator<Item = &Prepared> {
        self.claims.values()
    }

    /// Records a prepared claim and writes the file; on a failed write the book is as before.
    pub fn insert(&mut self, prepared: Prepared) -> Result<(), String> {
        let uid = prepared.uid.clone();
        let before = self.claims.insert(uid.clone(), prepared);
        self.save().inspect_err(|_| {
            match before {
                Some(before) => self.claims.insert(uid, before),
                None => self.claims.remove(&uid),
            };
        })
    }

    /// Forgets a claim and writes the file: the claim it held, if any. On a failed write the
    /// book is as before.
    pub fn remove(&mut self, uid: &str) -> Result<Option<Prepared>, String> {
        let Some(removed) = self.claims.remove(uid) else { return Ok(None) };
        match self.save() {
            Ok(()) => Ok(Some(removed)),
            Err(error) => {
                self.claims.insert(uid.to_owned(), removed);
                Err(error)
            }
        }
    }

    /// Writes the book through a temporary file beside it, synced, renamed into place, the
    /// directory synced ([`super::cdi::durable_replace`]).
    fn save(&self) -> Result<(), String> {
        let bytes = serde_json::to_vec_pretty(&OnDisk { version: VERSION, claims: self.claims.clone() }).map_err(|e| e.to_string())?;
        let temporary = self.path.with_extension("json.new");
        let written = (|| -> std::io::Result<()> {
            if let Some(dir) = self.path.parent() {
                fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
            }
            super::cdi::durable_replace(&temporary, &self.path, &bytes, 0o600)
        })();
        written.map_err(|error| format!("cannot write the DRA checkpoint {}: {error}", self.path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prepared::Share;

    fn claim(uid: &str, memory: u64) -> Prepared {
        Prepared {
            uid: uid.into(),
            namespace: "team".into(),
            name: format!("claim-{uid}"),
            shares: vec![Share {
                request: "gpu".into(),
                pool: "node-1".into(),
                device: "gpu-1".into(),
                gpu: 1,
                share_id: Some("6f1c0d36-0000-4000-8000-000000000001".into()),
                memory,
                cdi_device: format!("gpu.vramguard.io/claim={uid}-gpu-1"),
                admin_access: false,
            }],
        }
    }

    #[test]
    fn what_is_recorded_is_read_back_after_a_restart_and_what_is_removed_is_gone() {
        let dir = tempdir();
        let mut book = Checkpoint::open(&dir).expect("no file yet: empty");
        assert_eq!(book.claims().count(), 0);
        book.insert(claim("a", 8 << 30)).expect("write");
        book.insert(claim("b", 1 << 30)).expect("write");
        assert_eq!(book.remove("b").expect("write"), Some(claim("b", 1 << 30)));
        assert_eq!(book.remove("b").expect("nothing to write"), None);
        let again = Checkpoint::open(&dir).expect("read");
        assert_eq!(again.claims().cloned().collect::<Vec<_>>(), vec![claim("a", 8 << 30)]);
        let mode = fs::metadata(again.path()).expect("file").permissions();
        assert_eq!(mode.mode() & 0o777, 0o600);
        assert!(!dir.join("dra/checkpoint.json.new").exists(), "no temporary left");
    }

    #[test]
    fn the_directory_is_the_agents_alone_whoever_made_it() {
        let dir = tempdir();
        // Made 0755 by someone else (a hostPath DirectoryOrCreate, an older agent).
        fs::DirBuilder::new().mode(0o755).create(dir.join("dra")).expect("dir");
        fs::set_permissions(dir.join("dra"), fs::Permissions::from_mode(0o755)).expect("chmod");
        Checkpoint::own(&dir).expect("opened");
        assert_eq!(fs::metadata(dir.join("dra")).expect("dir").permissions().mode() & 0o777, 0o700);
    }

    #[test]
    fn a_corrupt_or_foreign_checkpoint_is_an_error_never_an_empty_book() {
        let dir = tempdir();
        fs::create_dir_all(dir.join("dra")).expect("dir");
        fs::write(dir.join("dra/checkpoint.json"), b"{\"version\": 1, \"claims\": ").expect("write");
        let error = Checkpoint::open(&dir).expect_err("truncated");
        assert!(error.contains("is not valid"), "{error}");
        fs::write(dir.join("dra/checkpoint.json"), b"{\"version\": 9, \"claims\": {}}").expect("write");
        let error = Checkpoint::open(&dir).expect_err("another version");
        assert!(error.contains("version 9"), "{error}");
    }

    #[test]
    fn a_failed_write_leaves_the_book_as_it_was() {
        let dir = tempdir();
        let mut book = Checkpoint::open(&dir).expect("empty");
        book.insert(claim("a", 1)).expect("write");
        // The directory made unwritable by a file in its place.
        fs::remove_dir_all(dir.join("dra")).expect("remove");
        fs::write(dir.join("dra"), b"").expect("a file where the directory was");
        assert!(book.insert(claim("b", 2)).is_err());
        assert!(book.remove("a").is_err());
        assert_eq!(book.claims().map(|c| c.uid.as_str()).collect::<Vec<_>>(), ["a"]);
    }

    fn tempdir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("vramguard-checkpoint-{}-{:?}", std::process::id(), std::thread::current().id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("temp dir");
        dir
    }
}
