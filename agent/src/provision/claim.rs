//! Containers of a DRA claim ([`crate::dra`]): provisioned from the claim's shares, exactly as
//! a `vramguard.io/gpu-memory` container is (the same ledger, limits, hook, preload and cgroup
//! limit, the same env-ignored guarantees), with the quota on each GPU the claim's
//! `consumedCapacity.memory` there.
//!
//! # Which claim: the runtime's word
//!
//! The claim's CDI spec ([`crate::prepared::cdi`]) mounts the claim's directory on the host
//! (`<state-dir>/dra/claims/<uid>`) into each container that gets one of its devices, and gives
//! it the device node of each of its GPUs. On containerd 1.7.24 (NRI 0.6.1) CreateContainer
//! hands the plugin the OCI spec with CDI's edits applied, whether the kubelet named the
//! devices in a `cdi.k8s.io/` annotation or in CRI's `CDI_devices`: the mount with its host
//! path, the device nodes in `linux.devices`, the spec's env (NRI's own `CDIDevices` field is
//! newer and empty there; tests/e2e/tests/dra_containerd.rs checks all of it). So:
//!
//! * a container whose mounts have a host path directly under `<state-dir>/dra/claims/` is a
//!   member of the claim that names that directory; nothing else makes it one. Its env
//!   ([`crate::prepared::cdi::CLAIM_ENV`] included) is the pod spec's to set and is never read; a
//!   mount's host path is set by the runtime from the CDI spec (a pod's hostPath volume
//!   could name it too, but a tenant allowed hostPath volumes owns the node anyway);
//! * the claim must be prepared on this node: in the checkpoint ([`crate::prepared::checkpoint`],
//!   re-read at each such creation: the agent's own small file, written before prepare
//!   answered the kubelet, which creates containers only after that);
//! * the container's GPU device nodes (`/dev/nvidia<N>`, the runtime's `linux.devices`) must
//!   be exactly the claim's GPUs: the ledger's devices are the container's GPUs in order.
//!
//! Anything else is refused (the creation fails with the reason), logged and counted in
//! `vramguard_dra_containers_refused_total{reason}` ([`Refusal`]). A container of a claim is
//! provisioned from it whatever quota file, annotation or pod limit would say otherwise; it
//! is left out of `--refuse-overcommit`'s sums, both ways: the scheduler placed the claim and
//! keeps the sum of `consumedCapacity` on each GPU within its capacity.
//!
//! # One quota for all the claim's containers
//!
//! A claim shared by several containers (of one pod or of several) has one quota: one ledger
//! per claim, which every container of the claim maps at [`ledger::provisioned::LEDGER`]. The
//! ledger's buddy space is the quota on each GPU, and admission across processes of all its
//! containers is one operation under the ledger's lock, so together they cannot exceed it;
//! each process has its slot (pid and pid namespace), reclaimed when it dies, whichever
//! container it ran in; the reconciler joins the ledger with the cgroups of all its live
//! processes. The claim's containers can write each other's ledger: they are one tenant
//! (a claim is namespaced, and shared on purpose); one that tampers with it harms its
//! co-claimants only, and is caught as any tampering is. Each container's cgroup limit is the
//! claim's whole quota (the probes' backstop for processes the hook does not see counts per
//! cgroup, not per claim). The ledger's metrics and audit rows carry the names of one of its
//! containers (the runtime's, as for any provisioned ledger).
//!
//! The ledger lives where a container's would, under a name no runtime gives a container
//! ([`ledger_id`]: `dra-<uid>`; container ids are hexadecimal): `<ledger-dir>/dra-<uid>/ledger`
//! in its own tmpfs, its header in `<state-dir>/containers/dra-<uid>/limits`; each member's
//! record (`containers/<id>/record.json`) names the claim ([`super::Record::claim`]). It is made
//! by the claim's first container and removed when its last container is removed
//! ([`Claims::forget`]), or at start if no member is left.
//!
//! # Unprepare: the ledger goes when no process of the claim is left
//!
//! The kubelet unprepares a claim once the pods using it have ended, but removes their dead
//! containers much later (its garbage collection): unprepare
//! ([`super::Provisioner::release_claim`], after the CDI spec and the checkpoint entry are
//! gone) removes the claim's ledger at once, with its members' records, when no member may
//! have a process left ([`Claims::release`]). Whether one may is the kernel's word on the
//! member's cgroup ([`liveness`]), never the tenant's (the ledger's slots are its to write):
//! `populated 0` in its `cgroup.events` (no process in it nor in any cgroup below it), or the
//! cgroup gone (the kernel refuses to remove a cgroup with processes; a container cannot
//! rename its own) while the tree above it is there (an agent that does not see the host's
//! cgroup2 tree, or a runtime that puts containers in none of its groups, sees neither: it
//! cannot tell). A member that may still run, one not recorded yet (its creation in flight)
//! and one whose cgroup cannot be told keep the ledger: it goes with the claim's last
//! container, as without unprepare; each such keep is a log line and a count in
//! `vramguard_dra_unprepared_ledgers_total{result="kept"}`. The members' later
//! RemoveContainer finds nothing left to remove.
use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Component, Path},
    sync::{Arc, Mutex},
};

use tracing::{info, warn};

use super::{gpus, nri::Adjustment, store::Store, Provisioned, Record, Workload};
use crate::prepared::{cdi, checkpoint::Checkpoint};

/// What a claim's ledger is named by in the store and the ledger directory.
pub fn ledger_id(uid: &str) -> String {
    format!("{LEDGER_PREFIX}{uid}")
}

const LEDGER_PREFIX: &str = "dra-";

/// Whether a store entry is a claim's ledger (not a container's).
pub fn is_ledger_id(id: &str) -> bool {
    id.starts_with(LEDGER_PREFIX)
}

/// A container's claim, as the runtime's spec and the checkpoint say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claimed {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    /// The claim's GPUs, ascending, and the quota on each (its shares there, summed).
    pub gpus: Vec<u32>,
    pub quotas: Vec<u64>,
    /// The claim has admin access (KEP-5018, every share [`crate::prepared::Share::admin_access`]):
    /// its containers are monitoring ones, given the claim's GPUs and no quota (`quotas` empty).
    pub admin_access: bool,
}

/// Why a container that names a claim is refused: the reason (the metric's label) and the
/// message the runtime fails the creation with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub reason: &'static str,
    pub message: String,
}

impl Refusal {
    fn new(reason: &'static str, message: String) -> Refusal {
        Refusal { reason, message: format!("vramguard: {message}") }
    }
}

/// The claim `workload` belongs to by the runtime's word (see the module doc), `None` if it
/// names none.
pub fn claimed(state_dir: &Path, workload: &Workload) -> Result<Option<Claimed>, Refusal> {
    let claims = cdi::claims_dir(state_dir);
    let mut uids = BTreeSet::new();
    for mount in &workload.mounts {
        let Ok(rest) = mount.source.strip_prefix(&claims) else { continue };
        let mut parts = rest.components();
        let uid = match (parts.next(), parts.next()) {
            (Some(std::path::Component::Normal(uid)), None) => uid.to_str().filter(|uid| cdi::valid_uid(uid)),
            _ => None,
        };
        let Some(uid) = uid else {
            return Err(Refusal::new("not_a_claim", format!("the mount of {} at {} is under the DRA claims' directory but is no claim's", mount.source.display(), mount.destination)));
        };
        uids.insert(uid.to_string());
    }
    let mut uids = uids.into_iter();
    let Some(uid) = uids.next() else { return Ok(None) };
    if let Some(other) = uids.next() {
        return Err(Refusal::new(
            "several_claims",
            format!("the container has devices of DRA claims {uid} and {other}: a container gets one claim of gpu.vramguard.io (ask for its GPUs in one claim)"),
        ));
    }
    let book = Checkpoint::open(state_dir).map_err(|error| Refusal::new("checkpoint", format!("claim {uid}: {error}")))?;
    let Some(prepared) = book.get(&uid) else {
        return Err(Refusal::new("not_prepared", format!("DRA claim {uid} is not prepared on this node (not in {})", book.path().display())));
    };
    let admin_access = prepared.shares.iter().any(|share| share.admin_access);
    if admin_access && !prepared.shares.iter().all(|share| share.admin_access) {
        // Prepare refuses such a claim; a checkpoint that holds one is not the driver's.
        return Err(Refusal::new("admin_access", format!("DRA claim {uid} mixes admin access and quotas: its containers are not created")));
    }
    let mut shares: BTreeMap<u32, u64> = BTreeMap::new();
    for share in &prepared.shares {
        let quota = shares.entry(share.gpu).or_default();
        *quota = quota.saturating_add(share.memory);
    }
    if shares.is_empty() || (!admin_access && shares.values().any(|&quota| quota == 0)) {
        return Err(Refusal::new("no_share", format!("DRA claim {uid} has no memory on some GPU of this node: {:?}", prepared.shares)));
    }
    let given = gpus::given(&workload.devices, &[], &BTreeMap::new(), u32::MAX).unwrap_or_default();
    let wanted: Vec<usize> = shares.keys().map(|&gpu| gpu as usize).collect();
    if given != wanted {
        let (extra, missing): (Vec<usize>, Vec<usize>) = (given.iter().filter(|g| !wanted.contains(g)).copied().collect(), wanted.iter().filter(|w| !given.contains(w)).copied().collect());
        return Err(if !given.is_empty() && missing.is_empty() {
            // Beside the claim's GPUs, another one: NVIDIA's device plugin (`nvidia.com/gpu`)
            // or its runtime gave it a GPU no claim accounts for.
            Refusal::new(
                "foreign_gpus",
                format!(
                    "the container of DRA claim {uid} also has GPUs {extra:?}, which its claim (GPUs {wanted:?}) does not hold: another device plugin \
                     (nvidia.com/gpu) gave them; ask for GPUs through the claim alone (the webhook converts nvidia.com/gpu with vramguard.io/gpu-memory)"
                ),
            )
        } else if !given.is_empty() && extra.is_empty() {
            // Some of the claim's GPUs: the container names one request of a claim whose
            // requests are on several GPUs; its ledger is the claim's, device by device.
            Refusal::new(
                "partial_claim",
                format!(
                    "the container of DRA claim {uid} has GPUs {given:?} of its claim's {wanted:?} (it names some of the claim's requests): a container \
                     gets all of its claim's GPUs (name the claim without `request`, or split it into claims of their own)"
                ),
            )
        } else {
            Refusal::new(
                "devices",
                format!("the container of DRA claim {uid} has the device nodes of GPUs {given:?}, the claim's are {wanted:?}: the runtime did not give it the claim's GPUs (alone)"),
            )
        });
    }
    Ok(Some(Claimed {
        uid,
        namespace: prepared.namespace.clone(),
        name: prepared.name.clone(),
        gpus: shares.keys().copied().collect(),
        quotas: if admin_access { Vec::new() } else { shares.values().copied().collect() },
        admin_access,
    }))
}

/// Where NVIDIA's device plugin also gave a claim's container GPUs in a way the runtime
/// resolves after NRI (so that no device node shows them yet): its `volume-mounts` strategy
/// (mounts under [`DEVICE_LIST_MOUNTS`], which the NVIDIA runtime reads as GPUs) or its
/// `envvar` strategy with its default `deviceIDStrategy: uuid` (`NVIDIA_VISIBLE_DEVICES`
/// naming a `GPU-…` UUID that is not one of the claim's GPUs'). Such a container was given a
/// GPU no claim accounts for (the device plugin counts it as taken): refused as
/// `foreign_gpus`, saying what to write. Only what can be told for sure is refused (a false
/// refusal stops an honest job): `all`, `void`, `none`, indices (NVML's numbering, which is
/// not the minor numbers claims use), MIG UUIDs and CDI names are left alone, as is every
/// UUID while the inventory does not know the claim's GPUs' UUIDs; the agent replaces the
/// variable with the claim's GPUs whatever it said. `uuid` names GPU `N`'s UUID where the
/// inventory knows it.
pub fn device_plugin_gpus(workload: &Workload, claim: &Claimed, uuid: &dyn Fn(u32) -> Option<String>) -> Option<Refusal> {
    let refusal = |how: String| {
        Refusal::new(
            "foreign_gpus",
            format!(
                "the container of DRA claim {} was also given GPUs by NVIDIA's device plugin ({how}), which its claim (GPUs {:?}) does not hold: \
                 ask for GPUs through the claim alone (remove nvidia.com/gpu from the container's resources; the webhook converts it with vramguard.io/gpu-memory)",
                claim.uid, claim.gpus
            ),
        )
    };
    if let Some(mount) = workload.mounts.iter().find(|m| device_list_mount(m)) {
        return Some(refusal(format!("its volume-mounts strategy: {}", mount.destination)));
    }
    let listed = workload.visible_devices.as_deref()?;
    let own: Option<Vec<String>> = claim.gpus.iter().map(|&gpu| uuid(gpu)).collect();
    let own = own?;
    let foreign: Vec<&str> = listed
        .split(',')
        .map(str::trim)
        .filter(|entry| entry.len() > 4 && entry.get(..4).is_some_and(|prefix| prefix.eq_ignore_ascii_case("GPU-")) && !own.iter().any(|uuid| uuid.eq_ignore_ascii_case(entry)))
        .collect();
    (!foreign.is_empty()).then(|| refusal(format!("NVIDIA_VISIBLE_DEVICES={listed}: {}", foreign.join(","))))
}

/// Where the NVIDIA container runtime reads a container's GPUs from mounts (the device
/// plugin's `volume-mounts` device list strategy).
pub const DEVICE_LIST_MOUNTS: &str = "/var/run/nvidia-container-devices";

/// Whether `mount` is a GPU of the device plugin's `volume-mounts` strategy as the NVIDIA
/// container runtime reads them: `/dev/null` mounted at a name under [`DEVICE_LIST_MOUNTS`]
/// (`..` resolved), the `cdi/` and `imex/` names (CDI devices, IMEX channels) not GPUs.
fn device_list_mount(mount: &crate::provision::nri::Mount) -> bool {
    if mount.source != Path::new("/dev/null") {
        return false;
    }
    let mut parts: Vec<&str> = Vec::new();
    for part in mount.destination.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            part => parts.push(part),
        }
    }
    let resolved = format!("/{}", parts.join("/"));
    resolved.strip_prefix(DEVICE_LIST_MOUNTS).and_then(|rest| rest.strip_prefix('/')).is_some_and(|name| {
        !name.is_empty() && !name.starts_with("cdi/") && !name.starts_with("imex/")
    })
}

/// What unprepare did with a claim's ledger ([`Claims::release`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Released {
    /// The claim has none (no container made it, or it went with the last one).
    NoLedger,
    /// Removed, with the records of these members (none had a process left).
    Removed { members: Vec<String> },
    /// Kept: these members may still run (id, why); it goes with the claim's last container.
    Kept { alive: Vec<(String, String)> },
}

/// Whether a container's processes may be alive, by the kernel's word on its cgroup.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Liveness {
    /// `populated 1`: a process in it or in a cgroup below it.
    Populated,
    /// `populated 0`: none.
    Empty,
    /// The cgroup is gone, the tree above it there.
    Gone,
    /// Cannot tell (why): counted as alive.
    Unknown(String),
}

impl Liveness {
    /// Whether no process of the container is left.
    pub fn ended(&self) -> bool {
        matches!(self, Liveness::Empty | Liveness::Gone)
    }
}

/// The liveness of the container whose cgroup is the runtime's `cgroups_path`, in the cgroup2
/// tree mounted at `root` (`None`: none is mounted).
pub fn liveness(root: Option<&Path>, cgroups_path: &str) -> Liveness {
    let Some(root) = root else { return Liveness::Unknown("no cgroup2 hierarchy is mounted".into()) };
    let Some(dir) = super::cgroup_dir(cgroups_path) else {
        return Liveness::Unknown(format!("the cgroup path {cgroups_path:?} names no cgroup"));
    };
    let relative = Path::new(dir.trim_start_matches('/'));
    let mut parts = relative.components();
    let first = match parts.next() {
        Some(Component::Normal(first)) if relative.components().all(|c| matches!(c, Component::Normal(_))) => first,
        _ => return Liveness::Unknown(format!("the cgroup path {cgroups_path:?} leaves the cgroup tree")),
    };
    let cgroup = root.join(relative);
    let events = cgroup.join("cgroup.events");
    match std::fs::read_to_string(&events) {
        Ok(text) => match text.lines().find_map(|line| line.strip_prefix("populated ")) {
            Some("0") => Liveness::Empty,
            Some("1") => Liveness::Populated,
            _ => Liveness::Unknown(format!("{} has no populated field", events.display())),
        },
        Err(error) if error.kind() == std::io::ErrorKind::NotFound && !cgroup.exists() => {
            // Gone only where the tree the runtime puts containers in is seen.
            if parts.next().is_some() && root.join(first).is_dir() {
                Liveness::Gone
            } else {
                Liveness::Unknown(format!(
                    "neither {} nor {} is there: the agent does not see the tree the runtime puts containers in",
                    cgroup.display(),
                    root.join(first).display()
                ))
            }
        }
        Err(error) => Liveness::Unknown(format!("cannot read {}: {error}", events.display())),
    }
}

/// Why recorded container `id` may still run (the kernel's word on its cgroup), `None` if
/// no process of it is left; a container not recorded yet (its creation in flight) may.
fn may_run(containers: &Mutex<BTreeMap<String, Provisioned>>, root: Option<&Path>, id: &str) -> Option<String> {
    let containers = containers.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let Some(member) = containers.get(id) else { return Some("being created (not recorded yet)".to_owned()) };
    match liveness(root, &member.record.cgroups_path) {
        Liveness::Populated => Some(format!("its cgroup {} has processes", member.record.cgroups_path)),
        Liveness::Unknown(why) => Some(why),
        Liveness::Empty | Liveness::Gone => None,
    }
}

/// The claims' ledgers, by claim UID, and the containers sharing each.
#[derive(Clone, Default)]
pub struct Claims {
    inner: Arc<Mutex<BTreeMap<String, Shared>>>,
}

struct Shared {
    ledger: Provisioned,
    /// The containers recorded as the claim's.
    members: BTreeSet<String>,
}

impl Claims {
    /// The claims' ledgers found in the store at start (`ledgers`, by [`is_ledger_id`]) and the
    /// restored containers: a ledger no container shares any more is removed now.
    pub fn restore(store: &Store, ledgers: Vec<Provisioned>, containers: &[Provisioned]) -> Claims {
        let mut claims = BTreeMap::new();
        for ledger in ledgers {
            let Some(uid) = ledger.record.container_id.strip_prefix(LEDGER_PREFIX).map(str::to_owned) else { continue };
            let members: BTreeSet<String> = containers
                .iter()
                .filter(|p| p.record.claim.as_deref() == Some(uid.as_str()))
                .map(|p| p.record.container_id.clone())
                .collect();
            if members.is_empty() {
                match store.remove(&ledger.record.container_id) {
                    Ok(()) => info!(claim = %uid, "a DRA claim's ledger without containers found at start: removed"),
                    Err(error) => warn!(claim = %uid, %error, "cannot remove a DRA claim's ledger without containers"),
                }
                continue;
            }
            claims.insert(uid, Shared { ledger, members });
        }
        Claims { inner: Arc::new(Mutex::new(claims)) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Shared>> {
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Provisions `record`'s container as a member of its claim (blocking: the store's files):
    /// the claim's ledger, made now if it is the first, and the container's record.
    pub fn create_member(&self, store: &Store, record: Record) -> Result<Provisioned, String> {
        let uid = record.claim.clone().ok_or_else(|| format!("container {} has no claim", record.container_id))?;
        let mut claims = self.lock();
        let ledger = match claims.get(&uid) {
            Some(shared) => shared.ledger.clone(),
            None => {
                let ledger = store.create(Record {
                    container_id: ledger_id(&uid),
                    pod_id: String::new(),
                    pod_uid: String::new(),
                    cgroups_path: String::new(),
                    container: String::new(),
                    claim: None,
                    ..record.clone()
                })?;
                claims.insert(uid.clone(), Shared { ledger: ledger.clone(), members: BTreeSet::new() });
                ledger
            }
        };
        let id = record.container_id.clone();
        let made = store.create_member(record, &ledger);
        match &made {
            Ok(_) => {
                if let Some(shared) = claims.get_mut(&uid) {
                    shared.members.insert(id);
                }
            }
            Err(_) => Claims::release_if_unused(store, &mut claims, &uid),
        }
        made
    }

    /// Container `id`'s record is gone: the ledger of its claim goes too if it was the claim's
    /// last container (blocking).
    pub fn forget(&self, store: &Store, id: &str) {
        let mut claims = self.lock();
        let Some(uid) = claims.iter_mut().find_map(|(uid, shared)| shared.members.remove(id).then(|| uid.clone())) else { return };
        Claims::release_if_unused(store, &mut claims, &uid);
    }

    fn release_if_unused(store: &Store, claims: &mut BTreeMap<String, Shared>, uid: &str) {
        if claims.get(uid).is_some_and(|shared| !shared.members.is_empty()) {
            return;
        }
        claims.remove(uid);
        match store.remove(&ledger_id(uid)) {
            Ok(()) => info!(claim = %uid, "the last container of a DRA claim is gone: the claim's ledger is removed"),
            Err(error) => warn!(claim = %uid, %error, "cannot remove the ledger of a DRA claim without containers"),
        }
    }

    /// Unprepare's step for claim `uid` (blocking: the store's files): its ledger and its
    /// members' records removed if `alive` says of none of its members that it may still run
    /// (`Some(why)`); kept otherwise. A removal that fails leaves the claim as it is, for the
    /// kubelet's next try.
    pub fn release(&self, store: &Store, uid: &str, alive: impl Fn(&str) -> Option<String>) -> Result<Released, String> {
        let mut claims = self.lock();
        let Some(shared) = claims.get(uid) else { return Ok(Released::NoLedger) };
        let running: Vec<(String, String)> = shared.members.iter().filter_map(|id| alive(id).map(|why| (id.clone(), why))).collect();
        if !running.is_empty() {
            return Ok(Released::Kept { alive: running });
        }
        let members: Vec<String> = shared.members.iter().cloned().collect();
        // The records first: a ledger without its members is removed at the next start.
        for id in &members {
            store.remove(id).map_err(|error| format!("claim {uid}: cannot remove the record of its container {id}: {error}"))?;
        }
        store.remove(&ledger_id(uid)).map_err(|error| format!("claim {uid}: cannot remove its ledger: {error}"))?;
        claims.remove(uid);
        Ok(Released::Removed { members })
    }

    /// The claims with a ledger now, and their containers.
    pub fn members(&self) -> BTreeMap<String, BTreeSet<String>> {
        self.lock().iter().map(|(uid, shared)| (uid.clone(), shared.members.clone())).collect()
    }
}

impl super::Provisioner {
    /// Unprepare's step for claim `uid` ([`Claims::release`]): its ledger removed if no
    /// member's cgroup has a process left ([`liveness`]; a member not recorded yet, its
    /// creation in flight, may run), its members forgotten; kept, logged and counted if one
    /// may still run. Idempotent.
    pub async fn release_claim(&self, uid: &str) -> Result<Released, String> {
        let (claims, store, containers, root) = (self.claims.clone(), self.store.clone(), self.containers.clone(), self.cgroup_root.clone());
        let owned = uid.to_owned();
        let released = tokio::task::spawn_blocking(move || claims.release(&store, &owned, |id| may_run(&containers, root.as_deref(), id)))
        .await
        .map_err(|error| format!("releasing DRA claim {uid}'s ledger failed: {error}"))??;
        match &released {
            Released::NoLedger => {}
            Released::Removed { members } => {
                {
                    let mut containers = self.lock();
                    for id in members {
                        containers.remove(id);
                    }
                }
                self.changed();
                self.counters.unprepared_ledger("removed");
                info!(claim = %uid, ?members, "DRA claim unprepared with no process of its containers left: its ledger and their records are removed");
            }
            Released::Kept { alive } => {
                self.counters.unprepared_ledger("kept");
                warn!(claim = %uid, ?alive, "DRA claim unprepared while its containers may still run: its ledger is kept, it goes with the claim's last container");
            }
        }
        Ok(released)
    }

    /// The members of claim `uid` that may still run, and why (the kernel's word on their
    /// cgroups, as [`Provisioner::release_claim`] asks it): empty when none may.
    pub async fn claim_in_use(&self, uid: &str) -> Vec<(String, String)> {
        let (claims, containers, root) = (self.claims.clone(), self.containers.clone(), self.cgroup_root.clone());
        let owned = uid.to_owned();
        let members = tokio::task::spawn_blocking(move || {
            let members = claims.members().remove(&owned).unwrap_or_default();
            members.into_iter().filter_map(|id| may_run(&containers, root.as_deref(), &id).map(|why| (id, why))).collect()
        });
        members.await.unwrap_or_else(|error| vec![(String::new(), format!("the check failed: {error}"))])
    }

    /// The claim `workload` belongs to (the checkpoint read on the blocking pool); a refusal is
    /// logged and counted here.
    pub(super) async fn claim_of(&self, workload: &Workload) -> Result<Option<Claimed>, String> {
        let inventory = self.gpus.borrow().clone();
        let uuid = |gpu: u32| inventory.as_ref().and_then(|inventory| inventory.gpu(gpu)).and_then(|gpu| gpu.uuid.clone());
        let found = self.look_up_claim(workload).await?.and_then(|claimed| match claimed {
            Some(claim) => device_plugin_gpus(workload, &claim, &uuid).map_or(Ok(Some(claim)), Err),
            None => Ok(None),
        });
        found.map_err(|refusal| {
            self.counters.claim_refused(refusal.reason);
            warn!(
                namespace = %workload.namespace, pod = %workload.pod, container = %workload.container, id = %workload.container_id,
                reason = refusal.reason, error = %refusal.message, "a container naming a DRA claim is refused"
            );
            refusal.message
        })
    }

    /// [`claimed`] on the blocking pool, neither logged nor counted (a container found at
    /// Synchronize is not refused).
    pub(super) async fn look_up_claim(&self, workload: &Workload) -> Result<Result<Option<Claimed>, Refusal>, String> {
        let (state_dir, owned) = (self.state_dir.clone(), workload.clone());
        tokio::task::spawn_blocking(move || claimed(&state_dir, &owned))
            .await
            .map_err(|error| format!("vramguard: looking up the container's DRA claim failed: {error}"))
    }

    /// What a container of admin-access claim `claim` is given: not provisioned (no ledger, no
    /// limit in the driver, no cgroup limit: a monitoring container beside the claims that
    /// hold the GPU; the probes still see and account its memory), only told its claim's GPUs
    /// (`NVIDIA_VISIBLE_DEVICES`), as every claim's container is. Logged, never recorded.
    pub(super) fn admin_access_container(&self, workload: &Workload, claim: &Claimed) -> Adjustment {
        info!(
            namespace = %workload.namespace, pod = %workload.pod, container = %workload.container, id = %workload.container_id,
            claim = %claim.uid, gpus = ?claim.gpus, admin_access = true,
            "a container of a DRA claim with admin access: created with its GPUs and no quota (monitoring)"
        );
        Adjustment { mounts: Vec::new(), env: vec![(super::NVIDIA_VISIBLE_DEVICES.into(), self.claim_visible_devices(&claim.gpus))] }
    }

    /// What the agent records of `workload` provisioned from `claim`.
    pub(super) fn claim_record(&self, workload: &Workload, claim: &Claimed) -> Record {
        let seen: Vec<usize> = claim.gpus.iter().map(|&gpu| gpu as usize).collect();
        let quota = claim.quotas.iter().copied().max().unwrap_or(0);
        let mut record = self.record(workload, quota, "dra claim", &seen);
        record.claim = Some(claim.uid.clone());
        record.quotas = claim.quotas.clone();
        record
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prepared::{Prepared, Share};
    use crate::provision::nri::Mount;

    pub(super) fn prepared(uid: &str, shares: &[(u32, u64)]) -> Prepared {
        Prepared {
            uid: uid.into(),
            namespace: "team-a".into(),
            name: format!("claim-{uid}"),
            shares: shares
                .iter()
                .map(|&(gpu, memory)| Share {
                    request: "gpu".into(),
                    pool: "node".into(),
                    device: crate::prepared::device_name(gpu),
                    gpu,
                    share_id: None,
                    memory,
                    cdi_device: cdi::qualified(uid, gpu),
                    admin_access: false,
                })
                .collect(),
        }
    }

    /// A container with the mounts of `claims` (host paths under `state`) and the device
    /// nodes of `gpus`.
    pub(crate) fn member(state: &Path, id: &str, claims: &[&str], gpus: &[u32]) -> Workload {
        let mut mounts = vec![Mount { source: "proc".into(), destination: "/proc".into(), read_only: false }];
        mounts.extend(claims.iter().map(|uid| Mount { source: cdi::claim_dir(state, uid), destination: cdi::claim_mount(uid), read_only: true }));
        Workload {
            pod_id: format!("sandbox-{id}"),
            pod_uid: format!("uid-{id}"),
            namespace: "team-a".into(),
            pod: format!("pod-{id}"),
            container_id: id.into(),
            container: "main".into(),
            cgroups_path: format!("/k8s.io/{id}"),
            devices: std::iter::once("/dev/nvidiactl".to_string()).chain(gpus.iter().map(|g| format!("/dev/nvidia{g}"))).collect(),
            mounts,
            ..Workload::default()
        }
    }

    fn state(tag: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("vramguard-claim-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        dir
    }

    #[test]
    fn the_claim_is_the_runtime_s_mount_of_a_prepared_claim_with_its_gpus() {
        let dir = state("claimed");
        let mut book = Checkpoint::open(&dir).expect("book");
        book.insert(prepared("u1", &[(1, 3 << 30), (1, 1 << 30), (3, 2 << 30)])).expect("write");
        book.insert(prepared("u2", &[(0, 1 << 30)])).expect("write");

        let claim = claimed(&dir, &member(&dir, "c1", &["u1"], &[1, 3])).expect("prepared").expect("a member");
        assert_eq!((claim.uid.as_str(), claim.gpus.as_slice(), claim.quotas.as_slice()), ("u1", &[1, 3][..], &[4 << 30, 2 << 30][..]));
        // The driver's control nodes (the CDI spec's) are no GPUs.
        let mut with_controls = member(&dir, "c1", &["u1"], &[1, 3]);
        with_controls.devices.extend(cdi::CONTROL_NODES.iter().map(|name| format!("/dev/{name}")));
        assert_eq!(claimed(&dir, &with_controls).expect("prepared").expect("a member").gpus, [1, 3]);
        // No claim mount: none (whatever else it mounts).
        assert_eq!(claimed(&dir, &member(&dir, "c2", &[], &[1])), Ok(None));

        let refused = |w: &Workload| claimed(&dir, w).expect_err("refused");
        let r = refused(&member(&dir, "c3", &["u9"], &[0]));
        assert_eq!(r.reason, "not_prepared", "{r:?}");
        assert!(r.message.contains("u9") && r.message.contains("not prepared"), "{r:?}");
        assert_eq!(refused(&member(&dir, "c4", &["u1", "u2"], &[0, 1, 3])).reason, "several_claims");
        // The claim's GPUs, no fewer, no more: some of them (one request named), one more
        // (another device plugin's), others, none.
        for (gpus, reason) in [(&[1][..], "partial_claim"), (&[1, 2, 3], "foreign_gpus"), (&[0, 1], "devices"), (&[], "devices")] {
            let r = refused(&member(&dir, "c5", &["u1"], gpus));
            assert_eq!(r.reason, reason, "{gpus:?}: {r:?}");
        }
        assert!(refused(&member(&dir, "c5", &["u1"], &[1, 2, 3])).message.contains("also has GPUs [2]"));
        // Under the claims' directory but no claim's: the directory itself, deeper, `..`.
        for source in [cdi::claims_dir(&dir), cdi::claim_dir(&dir, "u1").join("x"), cdi::claims_dir(&dir).join("..")] {
            let mut w = member(&dir, "c6", &[], &[1, 3]);
            w.mounts.push(Mount { source: source.clone(), destination: "/x".into(), read_only: true });
            assert_eq!(refused(&w).reason, "not_a_claim", "{}", source.display());
        }
        // An unreadable checkpoint refuses, never provisions from nothing.
        std::fs::write(dir.join("dra/checkpoint.json"), b"{").expect("corrupt");
        assert_eq!(refused(&member(&dir, "c7", &["u1"], &[1, 3])).reason, "checkpoint");
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}

#[cfg(test)]
mod provisioned {
    use super::tests::member;
    use super::*;
    use crate::provision::tests::{block_on, provisioner, provisioner_in};

    fn prepare(state: &Path, uid: &str, shares: &[(u32, u64)]) {
        let prepared = super::tests::prepared(uid, shares);
        Checkpoint::open(state).and_then(|mut book| book.insert(prepared)).expect("checkpoint");
    }

    /// Two containers of claim u1 share its ledger (its shares the devices' limits), a second
    /// claim on the same GPU has its own; the ledger goes with the claim's last container, and
    /// a restart restores the sharing.
    #[test]
    fn the_containers_of_a_claim_share_one_ledger_at_the_claim_s_shares() {
        // The quota file gives team-a 1 GiB: a claim's container takes its claim's quota instead.
        let (root, p) = provisioner("dra-claims", "namespace=team-a 1g\n", true);
        let state = root.join("state");
        prepare(&state, "u1", &[(0, 3 << 30), (1, 5 << 30)]);
        prepare(&state, "u2", &[(1, 2 << 30)]);
        let a = block_on(p.create_container(&member(&state, "a", &["u1"], &[0, 1]))).expect("a");
        let b = block_on(p.create_container(&member(&state, "b", &["u1"], &[0, 1]))).expect("b");
        let c = block_on(p.create_container(&member(&state, "c", &["u2"], &[1]))).expect("c");
        let shared = root.join("ledgers/dra-u1/ledger");
        assert_eq!((&a.mounts[0].source, &b.mounts[0].source), (&shared, &shared), "one ledger for the claim");
        assert_eq!(c.mounts[0].source, root.join("ledgers/dra-u2/ledger"));
        assert_eq!(a.mounts[1].source, b.mounts[1].source, "one limits file");
        // No inventory with UUIDs here: NVIDIA's runtime is told to give no GPU of its own.
        assert!(a.env.contains(&(super::super::NVIDIA_VISIBLE_DEVICES.into(), "none".into())), "{:?}", a.env);
        let made: BTreeMap<String, Provisioned> = p.provisioned().into_iter().map(|x| (x.record.container_id.clone(), x)).collect();
        let header = &made["a"].header;
        assert_eq!((header.device_count, header.devices[0].limit, header.devices[1].limit), (2, 3 << 30, 5 << 30));
        assert_eq!((made["c"].header.device_count, made["c"].header.devices[0].limit), (1, 2 << 30));
        // Each cgroup is held to its claim's whole quota; GPU 1 carries 7 GiB of claims on 8,
        // which --refuse-overcommit leaves to the scheduler.
        let limits = p.cgroup_limits();
        assert_eq!((limits["/k8s.io/a"], limits["/k8s.io/b"], limits["/k8s.io/c"]), (8 << 30, 8 << 30, 2 << 30));
        assert_eq!(p.pins().len(), 2, "one pin per ledger");

        block_on(p.remove_container("a"));
        assert!(shared.exists(), "b still shares it");
        drop(p);
        let again = provisioner_in(&root, true);
        assert_eq!(again.claims.members(), BTreeMap::from([("u1".into(), ["b".to_string()].into()), ("u2".into(), ["c".to_string()].into())]));
        let b_again = again.provisioned().into_iter().find(|x| x.record.container_id == "b").expect("b restored");
        assert_eq!((b_again.ledger, b_again.header.devices[1].limit), (shared.clone(), 5 << 30));
        block_on(again.synchronize(&["c".to_string()]));
        assert!(!shared.exists() && !state.join("containers/dra-u1").exists(), "its last container gone: the claim's ledger is removed");
        assert!(root.join("ledgers/dra-u2/ledger").exists());
        block_on(again.remove_pod("sandbox-c"));
        assert!(!root.join("ledgers/dra-u2").exists() && again.claims.members().is_empty());
        std::fs::remove_dir_all(&root).expect("cleanup");
    }

    /// A stand-in cgroup tree: the cgroup of each `(path, populated)` with its `cgroup.events`.
    fn cgroups(root: &Path, populated: &[(&str, u8)]) {
        for (path, populated) in populated {
            let dir = root.join(path.trim_start_matches('/'));
            std::fs::create_dir_all(&dir).expect("cgroup");
            std::fs::write(dir.join("cgroup.events"), format!("populated {populated}\nfrozen 0\n")).expect("events");
        }
    }

    #[test]
    fn a_claim_s_containers_are_given_its_gpus_by_uuid_for_nvidia_s_runtime() {
        let (root, p) = provisioner("dra-visible", "namespace=team-a 1g\n", true);
        let mut inventory = crate::inventory::from_flag(&[8 << 30; 4], 0);
        for gpu in &mut inventory.gpus {
            gpu.uuid = Some(format!("GPU-{}", gpu.index));
        }
        let p = p.with_inventory(crate::inventory::fixed(Some(inventory)), Vec::new());
        let state = root.join("state");
        prepare(&state, "u1", &[(1, 1 << 30), (3, 1 << 30)]);
        let adjustment = block_on(p.create_container(&member(&state, "a", &["u1"], &[1, 3]))).expect("provisioned");
        assert!(adjustment.env.contains(&(super::super::NVIDIA_VISIBLE_DEVICES.into(), "GPU-1,GPU-3".into())), "{:?}", adjustment.env);
        std::fs::remove_dir_all(&root).expect("cleanup");
    }

    #[test]
    fn liveness_is_the_kernel_s_populated_or_a_cgroup_gone_from_a_tree_that_is_seen() {
        let root = std::env::temp_dir().join(format!("vramguard-claim-cgroups-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        cgroups(&root, &[("/k8s.io/running", 1), ("/k8s.io/ended", 0), ("/kubepods.slice/kubepods-pod1.slice/cri-containerd-x.scope", 0)]);
        let live = |path: &str| liveness(Some(&root), path);
        assert_eq!(live("/k8s.io/running"), Liveness::Populated);
        assert_eq!(live("/k8s.io/ended"), Liveness::Empty);
        assert_eq!(live("kubepods-pod1.slice:cri-containerd:x"), Liveness::Empty, "systemd's path");
        assert_eq!(live("/k8s.io/removed"), Liveness::Gone);
        assert_eq!(live("kubepods-pod2.slice:cri-containerd:y"), Liveness::Gone, "its pod's slice gone too");
        // What cannot be told keeps the ledger: a tree the agent does not see, a cgroup at the
        // root, a path out of the tree, a cgroup without events, no cgroup2 at all.
        for path in ["/elsewhere/c", "/c", "/k8s.io/../k8s.io/ended", "", "a:b"] {
            assert!(matches!(live(path), Liveness::Unknown(_)), "{path}: {:?}", live(path));
        }
        std::fs::create_dir_all(root.join("k8s.io/odd")).expect("dir");
        assert!(matches!(live("/k8s.io/odd"), Liveness::Unknown(_)));
        assert!(matches!(liveness(None, "/k8s.io/ended"), Liveness::Unknown(_)));
        assert!(Liveness::Empty.ended() && Liveness::Gone.ended() && !Liveness::Populated.ended() && !Liveness::Unknown(String::new()).ended());
        std::fs::remove_dir_all(&root).expect("cleanup");
    }

    /// Unprepare removes a claim's ledger and its members' records at once when none of them
    /// has a process left, keeps it (counted) while one may run, also after a restart; the
    /// members' later removal finds nothing and fails nothing.
    #[test]
    fn unprepare_removes_the_ledger_of_a_claim_whose_containers_all_ended_and_keeps_a_running_one_s() {
        let (root, mut p) = provisioner("dra-release", "", false);
        let state = root.join("state");
        let cgroup_root = root.join("cgroup");
        p.cgroup_root = Some(cgroup_root.clone());
        prepare(&state, "u1", &[(0, 3 << 30)]);
        prepare(&state, "u2", &[(1, 2 << 30)]);
        block_on(p.create_container(&member(&state, "a", &["u1"], &[0]))).expect("a");
        block_on(p.create_container(&member(&state, "b", &["u1"], &[0]))).expect("b");
        block_on(p.create_container(&member(&state, "c", &["u2"], &[1]))).expect("c");
        // a ended (its cgroup empty), b runs; c's cgroup is gone.
        cgroups(&cgroup_root, &[("/k8s.io/a", 0), ("/k8s.io/b", 1)]);
        let ledger = root.join("ledgers/dra-u1");
        let kept = block_on(p.release_claim("u1")).expect("kept");
        assert_eq!(kept, Released::Kept { alive: vec![("b".into(), "its cgroup /k8s.io/b has processes".into())] });
        assert!(ledger.join("ledger").exists() && state.join("containers/dra-u1").exists() && state.join("containers/b").exists());
        assert_eq!((p.counters().unprepared_ledgers_total("kept"), p.counters().unprepared_ledgers_total("removed")), (1, 0));
        assert_eq!(block_on(p.release_claim("u2")).expect("removed"), Released::Removed { members: vec!["c".into()] });
        assert!(!root.join("ledgers/dra-u2").exists() && !state.join("containers/dra-u2").exists() && !state.join("containers/c").exists());
        assert!(!p.provisioned().iter().any(|x| x.record.container_id == "c") && !p.cgroup_limits().contains_key("/k8s.io/c"));
        // Idempotent; the member's removal later finds nothing left.
        assert_eq!(block_on(p.release_claim("u2")).expect("again"), Released::NoLedger);
        block_on(p.remove_container("c"));
        assert_eq!(p.counters().unprepared_ledgers_total("removed"), 1);

        // A restarted agent restores the claim and removes its ledger once b has ended too.
        drop(p);
        let mut again = provisioner_in(&root, false);
        again.cgroup_root = Some(cgroup_root.clone());
        assert!(matches!(block_on(again.release_claim("u1")), Ok(Released::Kept { .. })));
        cgroups(&cgroup_root, &[("/k8s.io/b", 0)]);
        assert_eq!(block_on(again.release_claim("u1")).expect("removed"), Released::Removed { members: vec!["a".into(), "b".into()] });
        assert!(!ledger.exists() && !state.join("containers/dra-u1").exists() && !state.join("containers/a").exists());
        assert!(again.provisioned().is_empty() && again.pins().is_empty() && again.claims.members().is_empty());
        block_on(again.remove_pod("sandbox-a"));
        block_on(again.remove_container("b"));
        assert!(again.is_empty());
        std::fs::remove_dir_all(&root).expect("cleanup");
    }

    /// A member whose creation is in flight (in the claim, not recorded yet) keeps the ledger.
    #[test]
    fn a_member_not_recorded_yet_keeps_the_ledger() {
        let (root, p) = provisioner("dra-release-flight", "", false);
        let state = root.join("state");
        prepare(&state, "u1", &[(0, 1 << 30)]);
        block_on(p.create_container(&member(&state, "a", &["u1"], &[0]))).expect("a");
        p.lock().remove("a");
        let kept = block_on(p.release_claim("u1")).expect("kept");
        assert_eq!(kept, Released::Kept { alive: vec![("a".into(), "being created (not recorded yet)".into())] });
        assert!(root.join("ledgers/dra-u1/ledger").exists());
        std::fs::remove_dir_all(&root).expect("cleanup");
    }

    #[test]
    fn a_container_naming_an_unprepared_claim_is_refused_and_counted() {
        let (root, p) = provisioner("dra-refused", "namespace=team-a 1g\n", false);
        let error = block_on(p.create_container(&member(&root.join("state"), "a", &["gone"], &[0]))).expect_err("not prepared");
        assert!(error.contains("claim gone is not prepared"), "{error}");
        assert_eq!((p.counters().claim_refused_total("not_prepared"), p.len()), (1, 0));
        assert!(!root.join("ledgers/dra-gone").exists() && !root.join("ledgers/a").exists());
        let error = block_on(p.create_container(&member(&root.join("state"), "dra-x", &[], &[0]))).expect_err("reserved id");
        assert!(error.contains("reserved"), "{error}");
        // Found at Synchronize (created while the agent was away): held to its claim's quota by
        // its cgroup limit; one of an unprepared claim is not refused (it runs already) and has
        // the quota the other sources give it (the quota file's 1 GiB).
        prepare(&root.join("state"), "u1", &[(1, 3 << 30)]);
        block_on(p.hold_unprovisioned(&[member(&root.join("state"), "late", &["u1"], &[1]), member(&root.join("state"), "stale", &["gone"], &[0])]));
        assert_eq!(p.cgroup_limits(), BTreeMap::from([("/k8s.io/late".to_string(), 3 << 30), ("/k8s.io/stale".to_string(), 1 << 30)]));
        assert_eq!(p.counters().claim_refused_total("not_prepared"), 1, "only the creation was refused");
        std::fs::remove_dir_all(&root).expect("cleanup");
    }

    #[test]
    fn a_device_plugin_s_mounts_or_variable_naming_other_gpus_make_foreign_gpus() {
        let claim = Claimed { uid: "u".into(), namespace: "team-a".into(), name: "c".into(), gpus: vec![2], quotas: vec![1 << 30], admin_access: false };
        let known = |gpu: u32| Some(format!("GPU-{gpu}aaa"));
        let with = |env: Option<&str>, mount: Option<&str>, uuid: &dyn Fn(u32) -> Option<String>| {
            let mut workload = member(Path::new("/state"), "id", &["u"], &[2]);
            workload.visible_devices = env.map(str::to_owned);
            workload.mounts.extend(mount.map(|m| crate::provision::nri::Mount { source: "/dev/null".into(), destination: m.into(), read_only: true }));
            workload.mounts.push(crate::provision::nri::Mount { source: "/host/data".into(), destination: "/var/run/nvidia-container-devices/GPU-6aaa".into(), read_only: true });
            device_plugin_gpus(&workload, &claim, uuid)
        };
        // Nothing a device plugin's for sure: indices are NVML's numbering, not minors.
        for fine in [None, Some("all"), Some("void"), Some("none"), Some(""), Some("2"), Some("0,1"), Some("GPU-2AAA"), Some("2, GPU-2aaa"), Some("MIG-1"), Some("nvidia.com/gpu=all")] {
            assert_eq!(with(fine, None, &known), None, "{fine:?}");
        }
        for (foreign, named) in [("GPU-5aaa", "GPU-5aaa"), ("GPU-2aaa,GPU-7aaa", "GPU-7aaa"), ("gpu-9aaa", "gpu-9aaa")] {
            let refusal = with(Some(foreign), None, &known).unwrap_or_else(|| panic!("{foreign} is another GPU"));
            assert_eq!(refusal.reason, "foreign_gpus");
            assert!(refusal.message.contains(&format!("NVIDIA_VISIBLE_DEVICES={foreign}: {named}")) && refusal.message.contains("does not hold"), "{}", refusal.message);
        }
        assert_eq!(with(Some("GPU-5aaa"), None, &|_| None), None, "the claim's UUIDs unknown: nothing can be told");
        assert_eq!(with(Some("GPé-x,ééé"), None, &known), None, "bytes of the tenant's, no panic");
        let refusal = with(Some("all"), Some("/var/run/nvidia-container-devices/GPU-5aaa"), &known).expect("the volume-mounts strategy");
        assert!(refusal.message.contains("volume-mounts strategy: /var/run/nvidia-container-devices/GPU-5aaa"), "{}", refusal.message);
        assert!(with(None, Some("/var/run/x/../nvidia-container-devices/0"), &known).is_some(), "`..` resolved as the runtime does");
        for honest in ["/var/run/nvidia-container-devicesX", "/var/run/nvidia-container-devices/imex/channel0", "/var/run/nvidia-container-devices/cdi/nvidia.com/gpu=0", "/var/run/nvidia-container-devices"] {
            assert_eq!(with(None, Some(honest), &known), None, "{honest}");
        }
    }
}
