//! What the agent keeps on the host for each container it provisioned, and only the agent
//! can write: under `--state-dir`, `containers/<container id>/` holds `record.json` (who the
//! container is, its quota, its cgroup, its ledger) and `limits` (the header of the ledger
//! the agent created: the limits the hook enforces, mounted read-only into the container);
//! the ledger itself is `<ledger-dir>/<container id>/ledger`, the one file the container can
//! write (mounted alone, read-write). After a restart the agent reads its records back
//! ([`Store::load`]) before the runtime's Synchronize says which containers still exist.
//!
//! With a [`Mounter`] (the agent always has one; unit tests may go without), each container's
//! ledger directory is a tmpfs of the ledger's size ([`super::mount`]): the container cannot
//! make its ledger, or anything else there, larger than the ledger's geometry.
//!
//! The ledger's geometry follows the container, not one fixed size ([`Sizing`],
//! [`ledger::Geometry::provisioned`]): a slot per process up to `--max-processes-per-container`,
//! records that grow with the quota's chunks, and each device's limit the quota cut to the
//! GPU's memory (`--gpu-memory`: a quota past it admits nothing more and would only make the
//! buddy space and its links larger). A 1-byte quota makes a ledger of about 230 KiB; the
//! largest (a whole 80 GiB GPU) about 4.2 MiB. The agent holds every ledger to the header it
//! created (its pin), never to what the file says.
//!
//! Container ids come from the runtime (trusted) but name directories: only ids of letters,
//! digits, `-`, `_` and `.` (not starting with `.`), at most 128 bytes, are accepted.
use std::{
    fs,
    io::Write as _,
    os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
};

use ledger::{
    layout::{Header, CONTAINER_CHUNK, CONTAINER_CONTEXT_RESERVE, CREATOR_AGENT},
    Geometry, Ledger,
};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use super::{metrics::Removed, mount::Mounter};

/// Who a provisioned container is and what it was given (`record.json`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub container_id: String,
    pub pod_id: String,
    pub pod_uid: String,
    pub namespace: String,
    pub pod: String,
    pub container: String,
    /// The runtime's `linux.cgroups_path` for the container.
    pub cgroups_path: String,
    /// The quota on each GPU, in bytes.
    pub quota: u64,
    /// The node's GPUs (the inventory's index range when the container was provisioned).
    pub devices: u32,
    /// The GPUs the runtime gave the container, as indices of the node's, in order: the
    /// ledger's devices (ledger device `i` is GPU `gpus[i]`, the container's driver ordinal
    /// `i`), each at `quota`; its cgroup's eBPF limit is `quota` times their number.
    pub gpus: Vec<u32>,
    /// Where the quota came from (`kubernetes`, `quota file`, `annotation`, `dra claim`).
    pub source: String,
    /// The DRA claim (its UID) whose ledger the container shares with the claim's other
    /// containers ([`super::claim`]): its ledger and limits are the claim's, not its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim: Option<String>,
    /// The quota on each of `gpus`, in their order, where they differ (a claim's shares);
    /// empty: `quota` on each.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub quotas: Vec<u64>,
}

impl Record {
    /// The cgroup's limit as the eBPF probes see it (all its GPUs together).
    pub fn cgroup_limit(&self) -> u64 {
        if self.quotas.is_empty() {
            cgroup_limit(self.quota, self.gpus.len())
        } else {
            self.quotas.iter().fold(0, |sum, quota| sum.saturating_add(*quota))
        }
    }

    /// The quota on ledger device `i` (GPU `gpus[i]`).
    pub fn quota_on(&self, i: usize) -> u64 {
        self.quotas.get(i).copied().unwrap_or(self.quota)
    }
}

/// A container's cgroup limit as the eBPF probes see it: `quota` on each of the `gpus` it
/// sees (at least one).
pub fn cgroup_limit(quota: u64, gpus: usize) -> u64 {
    quota.saturating_mul(gpus.max(1) as u64)
}

/// A provisioned container as the agent holds it: its record, the header it created, and
/// where the files are.
#[derive(Clone, Debug)]
pub struct Provisioned {
    pub record: Record,
    pub header: Header,
    /// The ledger on the host (mounted at [`ledger::provisioned::LEDGER`]).
    pub ledger: PathBuf,
    /// The header's copy on the host (mounted at [`ledger::provisioned::LIMITS`]).
    pub limits: PathBuf,
}

/// What sizes the ledgers the store creates (see the module doc).
#[derive(Clone, Debug)]
pub struct Sizing {
    /// Processes of one container that may use the GPU at once: the ledger's slots.
    pub processes: u32,
    /// The node's GPUs ([`crate::inventory`]): each one's memory is the most a device's limit
    /// is made (none before the inventory has them).
    pub gpus: crate::inventory::Shared,
}

/// The slots of a provisioned ledger when nothing says otherwise (`--max-processes-per-container`).
pub const DEFAULT_PROCESSES: u32 = 128;

impl Default for Sizing {
    fn default() -> Sizing {
        Sizing { processes: DEFAULT_PROCESSES, gpus: crate::inventory::fixed(None) }
    }
}

impl Sizing {
    /// The geometry of `record`'s ledger: one device per GPU it was given, at its quota cut
    /// to that GPU's memory when known.
    pub fn geometry(&self, record: &Record) -> Geometry {
        let limits: Vec<u64> = match record.gpus.is_empty() {
            true => vec![record.quota],
            false => record
                .gpus
                .iter()
                .enumerate()
                .map(|(i, &gpu)| {
                    let quota = record.quota_on(i);
                    crate::inventory::memory_of(&self.gpus, gpu as usize).map_or(quota, |memory| quota.min(memory))
                })
                .collect(),
        };
        Geometry::provisioned(&limits, CONTAINER_CHUNK, CONTAINER_CONTEXT_RESERVE, self.processes)
    }
}

/// The state directory and the ledger directory.
#[derive(Clone, Debug)]
pub struct Store {
    containers: PathBuf,
    ledger_dir: PathBuf,
    /// Mounts each ledger directory as a tmpfs of the ledger's size (`None`: plain
    /// directories, for unit tests).
    mounts: Option<Mounter>,
    sizing: Sizing,
}

/// Whether `id` can name a directory (see the module doc).
pub fn valid_container_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && !id.starts_with('.')
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

impl Store {
    /// The store under `state_dir` (created, mode 0700) for ledgers under `ledger_dir`, each
    /// in a tmpfs of its own made by `mounts`.
    pub fn open(state_dir: &Path, ledger_dir: &Path, mounts: Option<Mounter>) -> Result<Store, String> {
        let containers = state_dir.join("containers");
        fs::create_dir_all(&containers).map_err(|e| format!("cannot create {}: {e}", containers.display()))?;
        fs::set_permissions(&containers, fs::Permissions::from_mode(0o700))
            .map_err(|e| format!("cannot restrict {}: {e}", containers.display()))?;
        Ok(Store { containers, ledger_dir: ledger_dir.to_path_buf(), mounts, sizing: Sizing::default() })
    }

    /// The store, its ledgers sized by `sizing`.
    pub fn sized(self, sizing: Sizing) -> Store {
        Store { sizing, ..self }
    }

    /// The store sizing its ledgers by the inventory `gpus` too.
    pub fn resized(self, gpus: crate::inventory::Shared) -> Store {
        let sizing = Sizing { gpus, ..self.sizing };
        Store { sizing, ..self }
    }

    /// The bytes `record`'s ledger will take (its tmpfs: the file's size, whole pages).
    pub fn ledger_bytes(&self, record: &Record) -> Result<u64, String> {
        ledger::file::plan(&self.sizing.geometry(record), CREATOR_AGENT, 0)
            .map(|header| header.total_size)
            .map_err(|e| format!("cannot lay out the ledger of {}: {e}", record.container_id))
    }

    fn paths(&self, id: &str) -> (PathBuf, PathBuf, PathBuf) {
        let state = self.containers.join(id);
        (state.join("record.json"), state.join("limits"), self.ledger_dir.join(id).join("ledger"))
    }

    /// Creates the container's ledger with `record`'s quota on each of its GPUs, its
    /// limits file and its record. A container provisioned before (the runtime retried) gets
    /// what it was given then.
    pub fn create(&self, record: Record) -> Result<Provisioned, String> {
        let id = record.container_id.clone();
        if !valid_container_id(&id) {
            return Err(format!("container id {id:?} cannot name a directory"));
        }
        if let Some(existing) = self.load_one(&id)? {
            return Ok(existing);
        }
        let (record_path, limits, ledger_path) = self.paths(&id);
        let ledger_parent = ledger_path.parent().unwrap_or(&self.ledger_dir);
        // A ledger left by an earlier try that did not finish (no record): made again.
        let _ = self.remove_ledger_dir(ledger_parent)?;
        fs::create_dir_all(ledger_parent).map_err(|e| format!("cannot create {}: {e}", ledger_parent.display()))?;
        let geometry = self.sizing.geometry(&record);
        if let Some(mounts) = &self.mounts {
            let planned = ledger::file::plan(&geometry, CREATOR_AGENT, 0)
                .map_err(|e| format!("cannot lay out the ledger of {id}: {e}"))?;
            if let Err(error) = mounts.mount(ledger_parent, planned.total_size) {
                let _ = fs::remove_dir(ledger_parent);
                return Err(error);
            }
        }
        // Mapped here only while nobody else can reach the file: no container has it yet.
        let header = match Ledger::create(&ledger_path, &geometry, CREATOR_AGENT) {
            Ok(ledger) => *ledger.header(),
            Err(error) => {
                let _ = self.remove_ledger_dir(ledger_parent);
                return Err(format!("cannot create the ledger {}: {error}", ledger_path.display()));
            }
        };
        if self.mounts.is_some() {
            // Every page of the ledger allocated now (creating it wrote most of them already):
            // its tmpfs is then full, so the container gets ENOSPC at the ledger's end.
            if let Err(error) = allocate_whole(&ledger_path, header.total_size) {
                let _ = self.remove_ledger_dir(ledger_parent);
                return Err(error);
            }
        }
        // Every uid of the container writes it (it is reachable from that container only).
        fs::set_permissions(&ledger_path, fs::Permissions::from_mode(0o666))
            .map_err(|e| format!("cannot open up {}: {e}", ledger_path.display()))?;
        let state = record_path.parent().unwrap_or(&self.containers);
        fs::create_dir_all(state).map_err(|e| format!("cannot create {}: {e}", state.display()))?;
        write_new(&limits, ledger::file::header_bytes(&header), 0o444)?;
        let json = serde_json::to_vec_pretty(&record).map_err(|e| format!("cannot encode the record of {id}: {e}"))?;
        // Written last: a record names a container whose files are all there.
        write_new(&record_path, &json, 0o600)?;
        Ok(Provisioned { record, header, ledger: ledger_path, limits })
    }

    /// Records container `id` as a member of a claim whose ledger (`shared`, made by
    /// [`Store::create`] under [`super::claim::ledger_id`]) it shares: its record only. A
    /// container recorded before (the runtime retried) gets what it was given then.
    pub fn create_member(&self, record: Record, shared: &Provisioned) -> Result<Provisioned, String> {
        let id = record.container_id.clone();
        if !valid_container_id(&id) {
            return Err(format!("container id {id:?} cannot name a directory"));
        }
        if let Some(existing) = self.load_one(&id)? {
            return Ok(existing);
        }
        let (record_path, _, _) = self.paths(&id);
        let state = record_path.parent().unwrap_or(&self.containers);
        fs::create_dir_all(state).map_err(|e| format!("cannot create {}: {e}", state.display()))?;
        let json = serde_json::to_vec_pretty(&record).map_err(|e| format!("cannot encode the record of {id}: {e}"))?;
        write_new(&record_path, &json, 0o600)?;
        Ok(Provisioned { record, header: shared.header, ledger: shared.ledger.clone(), limits: shared.limits.clone() })
    }

    /// The container `id`'s files, if it was provisioned and they are whole.
    fn load_one(&self, id: &str) -> Result<Option<Provisioned>, String> {
        let (record_path, mut limits, mut ledger) = self.paths(id);
        let json = match fs::read(&record_path) {
            Ok(json) => json,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(error) => return Err(format!("cannot read {}: {error}", record_path.display())),
        };
        let record: Record = serde_json::from_slice(&json).map_err(|e| format!("{} is not a record: {e}", record_path.display()))?;
        if record.container_id != id {
            return Err(format!("{} names container {:?}", record_path.display(), record.container_id));
        }
        if let Some(uid) = &record.claim {
            // A claim's member: the claim's ledger and limits.
            (_, limits, ledger) = self.paths(&super::claim::ledger_id(uid));
        }
        let bytes = fs::read(&limits).map_err(|e| format!("cannot read {}: {e}", limits.display()))?;
        let header = ledger::file::header_from_bytes(&bytes).ok_or_else(|| format!("{} is not a ledger header", limits.display()))?;
        Ok(Some(Provisioned { record, header, ledger, limits }))
    }

    /// Every provisioned container on record, and the reasons of those that could not be read.
    pub fn load(&self) -> (Vec<Provisioned>, Vec<String>) {
        let (mut found, mut problems) = (Vec::new(), Vec::new());
        let entries = match fs::read_dir(&self.containers) {
            Ok(entries) => entries,
            Err(error) => return (found, vec![format!("cannot list {}: {error}", self.containers.display())]),
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(id) = name.to_str().filter(|id| valid_container_id(id)) else { continue };
            match self.load_one(id) {
                Ok(Some(provisioned)) => found.push(provisioned),
                Ok(None) => problems.push(format!("{}: no record (an unfinished provisioning): removed", entry.path().display())),
                Err(error) => problems.push(error),
            }
        }
        found.sort_by(|a, b| a.record.container_id.cmp(&b.record.container_id));
        (found, problems)
    }

    /// Removes what the agent keeps for container `id` (its ledger included).
    pub fn remove(&self, id: &str) -> Result<(), String> {
        self.remove_counted(id).map(|_| ())
    }

    /// [`Store::remove`], saying what there was to remove.
    pub fn remove_counted(&self, id: &str) -> Result<Removed, String> {
        if !valid_container_id(id) {
            return Err(format!("container id {id:?} cannot name a directory"));
        }
        let (record_path, _, ledger) = self.paths(id);
        let mut removed = Removed { record: record_path.exists(), ledger: ledger.exists(), mount: false };
        // The record first: what is left without it is an unfinished provisioning.
        if let Some(state) = record_path.parent() {
            remove_all(state)?;
        }
        if let Some(dir) = ledger.parent() {
            removed.mount = self.remove_ledger_dir(dir)?;
        }
        Ok(removed)
    }

    /// Removes a container's ledger directory: its tmpfs unmounted first (the files go with
    /// it once no container holds them), then the directory. Whether a tmpfs was unmounted.
    fn remove_ledger_dir(&self, dir: &Path) -> Result<bool, String> {
        let unmounted = match &self.mounts {
            Some(mounts) => mounts.unmount(dir)?,
            None => false,
        };
        remove_all(dir)?;
        Ok(unmounted)
    }

    /// Unmounts the ledger tmpfs mounts of containers without a record (left by a crash
    /// between the removal of a record and its ledger's), and removes their directories.
    pub fn unmount_leftovers(&self) {
        let Some(mounts) = &self.mounts else { return };
        for dir in mounts.ours(&self.ledger_dir) {
            let Some(id) = dir.file_name().and_then(|n| n.to_str()).filter(|id| valid_container_id(id)) else { continue };
            if self.containers.join(id).join("record.json").exists() {
                continue;
            }
            match self.remove_ledger_dir(&dir) {
                Ok(_) => info!(dir = %dir.display(), "a ledger tmpfs left without its container's record: unmounted and removed"),
                Err(error) => warn!(dir = %dir.display(), %error, "cannot remove a ledger tmpfs left without its container's record"),
            }
        }
    }

    /// Removes state directories without a record (a provisioning cut short by a crash).
    pub fn remove_unfinished(&self) {
        let Ok(entries) = fs::read_dir(&self.containers) else { return };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(id) = name.to_str().filter(|id| valid_container_id(id)) else { continue };
            if !entry.path().join("record.json").exists() {
                let _ = self.remove(id);
            }
        }
    }
}

/// Allocates the first `size` bytes of the file at `path` (fallocate(2), the size unchanged).
fn allocate_whole(path: &Path, size: u64) -> Result<(), String> {
    let file = fs::OpenOptions::new().write(true).open(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let length = libc::off_t::try_from(size).map_err(|_| format!("{}: size {size} out of range", path.display()))?;
    // SAFETY: fallocate(2) on a descriptor owned by `file`, alive across the call.
    let rc = unsafe { libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(&file), 0, 0, length) };
    if rc == 0 {
        Ok(())
    } else {
        Err(format!("cannot allocate the {size} bytes of {}: {}", path.display(), std::io::Error::last_os_error()))
    }
}

/// Removes `dir` and everything in it; absent is not an error.
fn remove_all(dir: &Path) -> Result<(), String> {
    match fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(error) => Err(format!("cannot remove {}: {error}", dir.display())),
    }
}

/// Writes `bytes` to a new file at `path` (replacing any) with `mode`, through a temporary
/// file renamed into place.
pub(crate) fn write_new(path: &Path, bytes: &[u8], mode: u32) -> Result<(), String> {
    let temporary = path.with_extension("new");
    let _ = fs::remove_file(&temporary);
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&temporary)
        .map_err(|e| format!("cannot create {}: {e}", temporary.display()))?;
    file.write_all(bytes).and_then(|()| file.sync_all()).map_err(|e| format!("cannot write {}: {e}", temporary.display()))?;
    fs::rename(&temporary, path).map_err(|e| format!("cannot rename {} to {}: {e}", temporary.display(), path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn record(id: &str) -> Record {
        Record {
            container_id: id.into(),
            pod_id: "sandbox".into(),
            pod_uid: "uid-1".into(),
            namespace: "team-a".into(),
            pod: "trainer".into(),
            container: "main".into(),
            cgroups_path: "/k8s.io/abc".into(),
            quota: 1 << 30,
            devices: 4,
            gpus: vec![1, 3],
            source: "quota file".into(),
            claim: None,
            quotas: Vec::new(),
        }
    }

    #[test]
    fn create_load_remove() {
        let root = std::env::temp_dir().join(format!("vramguard-store-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let store = Store::open(&root.join("state"), &root.join("ledgers"), None).expect("store");
        let made = store.create(record("c1")).expect("create");
        // One ledger device per GPU given (GPUs 1 and 3 of the node's 4), each at the quota.
        assert_eq!(made.header.device_count, 2);
        assert!(made.header.devices[..2].iter().all(|d| d.limit == 1 << 30));
        assert_eq!(made.ledger, root.join("ledgers/c1/ledger"));
        let mode = |p: &Path| fs::metadata(p).expect("stat").permissions().mode() & 0o777;
        assert_eq!((mode(&made.ledger), mode(&made.limits)), (0o666, 0o444));
        assert_eq!(fs::read(&made.limits).expect("limits"), ledger::file::header_bytes(&made.header));
        // The same container again: the same files, not a new ledger.
        let again = store.create(record("c1")).expect("again");
        assert_eq!(ledger::file::header_bytes(&again.header), ledger::file::header_bytes(&made.header));

        store.create(record("c2")).expect("c2");
        fs::create_dir_all(root.join("state/containers/c3")).expect("unfinished");
        let (found, problems) = store.load();
        assert_eq!(found.iter().map(|p| p.record.container_id.as_str()).collect::<Vec<_>>(), ["c1", "c2"]);
        assert_eq!(found[0].record, record("c1"));
        assert_eq!(problems.len(), 1, "{problems:?}");
        store.remove_unfinished();
        assert!(!root.join("state/containers/c3").exists());

        store.remove("c1").expect("remove");
        assert!(!root.join("ledgers/c1").exists() && !root.join("state/containers/c1").exists());
        assert_eq!(store.load().0.len(), 1);
        assert!(store.create(record("../x")).is_err());
        assert!(store.remove("..").is_err());
        fs::remove_dir_all(&root).expect("cleanup");
    }

    /// The ledger follows the quota and the process bound: a 1-byte quota on one GPU is a
    /// device with no space in a file of a few hundred KiB; a quota past a GPU's memory is cut
    /// to it; records grow with the quota.
    #[test]
    fn ledgers_are_sized_by_quota_processes_and_gpu_memory() {
        let root = std::env::temp_dir().join(format!("vramguard-store-sized-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let gpus = crate::inventory::fixed(Some(crate::inventory::from_flag(&[8 << 30, 8 << 30, 8 << 30, 4 << 30], 0)));
        let sizing = Sizing { processes: 16, gpus };
        let store = Store::open(&root.join("state"), &root.join("ledgers"), None).expect("store").sized(sizing);
        let tiny = store.create(Record { quota: 1, ..record("t1") }).expect("a 1-byte quota is provisioned");
        assert_eq!((tiny.header.slot_count, tiny.header.devices[0].limit, tiny.header.devices[0].chunks), (16, 0, 0));
        assert!(tiny.header.total_size < 256 << 10, "{}", tiny.header.total_size);
        assert_eq!(Ledger::open(&tiny.ledger).expect("it opens").header().device_count, 2);
        // GPUs 1 and 3: 8 and 4 GiB; a 6 GiB quota is 6 GiB on GPU 1 and 4 GiB on GPU 3.
        let cut = store.create(Record { quota: 6 << 30, ..record("c1") }).expect("create");
        assert_eq!((cut.header.devices[0].limit, cut.header.devices[1].limit), (6 << 30, 4 << 30));
        assert_eq!(cut.record.quota, 6 << 30, "the record keeps the quota (the cgroup's limit)");
        assert!(cut.header.record_count > tiny.header.record_count && cut.header.total_size > tiny.header.total_size);
        fs::remove_dir_all(&root).expect("cleanup");
    }

    #[test]
    fn container_ids() {
        assert!(valid_container_id("3f9a0c1b2d_e-f.1"));
        for bad in ["", ".", "..", ".hidden", "a/b", "a b", &"x".repeat(129)] {
            assert!(!valid_container_id(bad), "{bad:?}");
        }
    }
}

#[cfg(test)]
mod capped {
    use std::os::unix::fs::{FileExt as _, MetadataExt as _};

    use super::*;

    fn statvfs_free(path: &Path) -> u64 {
        let stat = nix::sys::statvfs::statvfs(path).expect("statvfs");
        stat.blocks_free() as u64 * stat.fragment_size() as u64
    }

    /// A ledger in its own tmpfs: the file cannot be written or allocated past its size; an
    /// extending ftruncate allocates nothing; removal and leftover clean-up unmount it.
    #[test]
    fn a_ledger_lives_in_a_tmpfs_of_its_size() {
        let root = std::env::temp_dir().join(format!("vramguard-store-capped-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let ledgers = root.join("ledgers");
        let mounter = Mounter::default();
        let store = Store::open(&root.join("state"), &ledgers, Some(mounter.clone())).expect("store");
        let made = store.create(tests_record("m1")).expect("create");
        let dir = made.ledger.parent().expect("dir").to_path_buf();
        assert_eq!(mounter.ours(&ledgers), std::slice::from_ref(&dir));
        let size = made.header.total_size;
        eprintln!("ledger of {size} bytes; tmpfs free {} bytes", statvfs_free(&dir));
        let file = fs::OpenOptions::new().read(true).write(true).open(&made.ledger).expect("open");
        assert_eq!(file.metadata().expect("stat").blocks() * 512, size, "the ledger allocated whole");
        assert_eq!(statvfs_free(&dir), 0, "its tmpfs full");
        let page = vec![0x5a_u8; 4096];
        let error = file.write_at(&page, size).expect_err("write past the size");
        assert_eq!(error.raw_os_error(), Some(libc::ENOSPC), "{error}");
        // SAFETY: fallocate(2) on a descriptor this test owns.
        let rc = unsafe { libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(&file), 0, size as libc::off_t, 4096) };
        assert_eq!((rc, std::io::Error::last_os_error().raw_os_error()), (-1, Some(libc::ENOSPC)), "fallocate past the size");
        let blocks = file.metadata().expect("stat").blocks();
        file.set_len(size * 4).expect("an extending ftruncate succeeds on tmpfs");
        assert_eq!(file.metadata().expect("stat").blocks(), blocks, "and allocates nothing");
        let error = file.write_at(&page, size * 2).expect_err("write into the extension");
        assert_eq!(error.raw_os_error(), Some(libc::ENOSPC), "{error}");
        drop(file);

        // The record gone but not the ledger (a crash between the two): unmounted at start.
        fs::remove_dir_all(root.join("state/containers/m1")).expect("record");
        store.unmount_leftovers();
        assert!(mounter.ours(&ledgers).is_empty() && !dir.exists());
        // Created and removed: unmounted.
        store.create(tests_record("m2")).expect("create");
        assert_eq!(mounter.ours(&ledgers).len(), 1);
        store.remove("m2").expect("remove");
        assert!(mounter.ours(&ledgers).is_empty() && !ledgers.join("m2").exists());
        fs::remove_dir_all(&root).expect("cleanup");
    }

    fn tests_record(id: &str) -> Record {
        Record { devices: 1, gpus: vec![0], ..super::tests::record(id) }
    }
}
