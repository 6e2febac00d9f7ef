//! Prepare and unprepare: what the kubelet's `NodePrepareResources` and
//! `NodeUnprepareResources` do for each claim, apart from the wire ([`super::plugin`]).
//!
//! Prepare takes the claim from the API server ([`Claims`]), checks that it is the claim the
//! kubelet means (its `metadata.uid`) and that it is allocated, takes the allocation results
//! of [`DRIVER`] in this node's pool as [`Share`]s (the quota on a GPU is the result's
//! `consumedCapacity.memory`; a result without one, as the API server leaves every result
//! where the `DRAConsumableCapacity` gate is off, has the GPU whole: its published
//! capacity), refuses a share that would make the prepared memory on its GPU exceed the
//! GPU's capacity as the node's [`inventory`] publishes it (the driver's own check that the
//! scheduler did not over-commit), then writes the claim's CDI spec and records it in the
//! [`Checkpoint`] before answering. A claim already recorded is answered from the checkpoint
//! without the API server, its spec written again first if it is missing or different (a
//! reboot empties `/var/run/cdi`, a tmpfs, and keeps the checkpoint: kubernetes#141433); at
//! start [`Preparer::restore`] writes every recorded claim's spec and removes the specs of
//! claims not recorded (a crash between the two writes). Prepare is idempotent, and so is
//! unprepare (a claim the checkpoint does not hold is unprepared
//! already), which needs nothing but the checkpoint (the claim may be gone from the API
//! server). Unprepare then asks the provisioner ([`crate::provision::Provisioner::release_claim`],
//! with `--nri`) to remove the claim's ledger, which it does at once if no process of the
//! claim's containers is left (the kubelet removes their dead containers much later), or
//! leaves to the claim's last container; asked whether or not the checkpoint held the claim,
//! so that the kubelet's next try (or a restarted agent's, which restores the claims' ledgers)
//! finishes what failed.
//!
//! Each claim is answered on its own, within [`CLAIM_DEADLINE`] (the kubelet waits 45 s for
//! the whole call): one claim's failure is its error in the answer, never the call's. The
//! files and the checkpoint's fsync are written on the blocking pool, one claim at a time (the
//! capacity check and the record are one step).
use std::{
    collections::{BTreeMap, BTreeSet},
    future::Future,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Duration,
};

use k8s_openapi::api::resource::v1::ResourceClaim;
use tokio::sync::watch;

use super::{cdi, checkpoint::Checkpoint, device_index, Prepared, Share, DRIVER, MEMORY};
use crate::{
    fault::die_at,
    inventory::{self, Inventory},
    provision::Provisioner,
    quantity::parse_quantity,
};

/// How long one claim's prepare or unprepare may take, the API server's answer included:
/// past it the claim's answer is an error, well before the kubelet's 45 s.
pub const CLAIM_DEADLINE: Duration = Duration::from_secs(30);

/// Where prepare gets a ResourceClaim from: the API server ([`KubeClaims`]), or a test's.
pub trait Claims: Send + Sync + 'static {
    /// The claim `namespace/name`; `Ok(None)`: the API server does not have it.
    fn get(&self, namespace: &str, name: &str) -> impl Future<Output = Result<Option<ResourceClaim>, String>> + Send;
}

/// The API server's ResourceClaims (`GET /apis/resource.k8s.io/v1/namespaces/<ns>/resourceclaims/<name>`).
pub struct KubeClaims(pub kube::Client);

impl Claims for KubeClaims {
    async fn get(&self, namespace: &str, name: &str) -> Result<Option<ResourceClaim>, String> {
        let api: kube::Api<ResourceClaim> = kube::Api::namespaced(self.0.clone(), namespace);
        api.get_opt(name).await.map_err(|e| format!("the API server: {e}"))
    }
}

/// Why a claim was not prepared: its error to the kubelet and its `reason` label.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub reason: Reason,
    pub message: String,
}

/// The `reason` label of a refusal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// The API server could not be asked, or did not answer in time.
    Api,
    /// The API server has no such claim.
    NotFound,
    /// The API server's claim has another UID than the kubelet's (deleted and re-created).
    UidChanged,
    /// The claim has no `status.allocation`.
    NotAllocated,
    /// The node's GPUs are not known yet (NVML has not answered, and no `--gpu-memory`).
    NoInventory,
    /// The agent is not connected to the runtime's NRI: a container of the claim would be
    /// created without its ledger and limit.
    NriDown,
    /// No result of this driver in this node's pool.
    NoDevice,
    /// A result that this driver cannot serve: not one of its device names, a GPU the node
    /// does not have, no `consumedCapacity.memory`, two results on one GPU.
    BadResult,
    /// The shares would exceed a GPU's memory.
    OverCapacity,
    /// A claim with both admin-access results and results with a quota: a container of it
    /// would get GPUs with a ledger and GPUs without one (ask them in two claims).
    AdminAccess,
    /// The CDI spec or the checkpoint could not be written.
    Write,
    /// Past [`CLAIM_DEADLINE`].
    Timeout,
}

impl Reason {
    pub const ALL: [Reason; 12] = [
        Reason::Api,
        Reason::NotFound,
        Reason::UidChanged,
        Reason::NotAllocated,
        Reason::NoInventory,
        Reason::NriDown,
        Reason::NoDevice,
        Reason::BadResult,
        Reason::OverCapacity,
        Reason::AdminAccess,
        Reason::Write,
        Reason::Timeout,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Reason::Api => "api",
            Reason::NotFound => "not_found",
            Reason::UidChanged => "uid_changed",
            Reason::NotAllocated => "not_allocated",
            Reason::NoInventory => "no_inventory",
            Reason::NriDown => "nri_down",
            Reason::NoDevice => "no_device",
            Reason::BadResult => "bad_result",
            Reason::OverCapacity => "over_capacity",
            Reason::AdminAccess => "admin_access",
            Reason::Write => "write",
            Reason::Timeout => "timeout",
        }
    }
}

fn refuse(reason: Reason, message: String) -> Refusal {
    Refusal { reason, message }
}

/// What the kubelet names of a claim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Asked {
    pub namespace: String,
    pub uid: String,
    pub name: String,
}

/// How a prepare ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Prepared now.
    Prepared(Prepared),
    /// Prepared before: the checkpoint's record.
    Repeated(Prepared),
}

impl Outcome {
    pub fn prepared(&self) -> &Prepared {
        match self {
            Outcome::Prepared(p) | Outcome::Repeated(p) => p,
        }
    }
}

/// The node's prepared claims and how to prepare more.
pub struct Preparer<C> {
    claims: C,
    /// This node's name: the driver's pool.
    node: String,
    /// The node's GPUs, as the slices publish them.
    gpus: inventory::Shared,
    cdi_dir: PathBuf,
    state_dir: PathBuf,
    /// Where the GPUs' device nodes are on the host and as the agent sees them
    /// (`--dra-device-dir`, `--dra-host-dev`).
    nodes: cdi::Nodes,
    /// Locked on the blocking pool only.
    checkpoint: Arc<Mutex<Checkpoint>>,
    /// The claims' ledgers (`--nri`): unprepare removes a claim's.
    ledgers: Option<Arc<Provisioner>>,
    /// The GPUs a prepared claim holds whole (results without a `shareID`: the scheduler gave
    /// it the device whole), for the slices: such a GPU is published whole until those claims
    /// are unprepared, since the scheduler does not weigh a device's dedicated allocation
    /// against the shares it places on it once it is published shared.
    whole: Arc<watch::Sender<BTreeSet<u32>>>,
    /// Whether the NRI side is connected to the runtime (`None`: not asked, the tests'): no
    /// claim is prepared, not even again, while it is not.
    nri: Option<watch::Receiver<bool>>,
}

/// The GPUs `checkpoint`'s claims hold whole (an admin-access share holds nothing).
fn whole_gpus(checkpoint: &Checkpoint) -> BTreeSet<u32> {
    checkpoint.claims().flat_map(|c| &c.shares).filter(|share| share.share_id.is_none() && !share.admin_access).map(|share| share.gpu).collect()
}

impl<C: Claims> Preparer<C> {
    pub fn new(claims: C, node: String, gpus: inventory::Shared, cdi_dir: PathBuf, state_dir: PathBuf, checkpoint: Checkpoint) -> Preparer<C> {
        let whole = Arc::new(watch::channel(whole_gpus(&checkpoint)).0);
        Preparer { claims, node, gpus, cdi_dir, state_dir, nodes: cdi::Nodes::host(), checkpoint: Arc::new(Mutex::new(checkpoint)), ledgers: None, whole, nri: None }
    }

    /// The preparer that prepares nothing while `connected` (the NRI side's) is false.
    pub fn with_nri(self, connected: Option<watch::Receiver<bool>>) -> Preparer<C> {
        Preparer { nri: connected, ..self }
    }

    /// The GPUs the prepared claims hold whole, kept current.
    pub fn held_whole(&self) -> watch::Receiver<BTreeSet<u32>> {
        self.whole.subscribe()
    }

    /// Tells the slices which GPUs are held whole now.
    async fn tell_whole(&self) {
        let checkpoint = self.checkpoint.clone();
        if let Ok(now) = blocking(move || Ok(whole_gpus(&lock(&checkpoint)))).await {
            self.whole.send_if_modified(|held| {
                let changed = *held != now;
                *held = now;
                changed
            });
        }
    }

    /// The preparer whose unprepare removes a claim's ledger through `provisioner` (the NRI
    /// side's, which made it).
    pub fn with_ledgers(self, provisioner: Option<Arc<Provisioner>>) -> Preparer<C> {
        Preparer { ledgers: provisioner, ..self }
    }

    /// The preparer with the GPUs' device nodes at `nodes` (the CDI specs' host paths, and
    /// where the agent sees them) instead of the host's `/dev`.
    pub fn with_nodes(self, nodes: cdi::Nodes) -> Preparer<C> {
        Preparer { nodes, ..self }
    }

    /// What an agent does at start, before it serves the kubelet: every recorded claim's spec
    /// written where it is missing or different (after a reboot the CDI directory, a tmpfs,
    /// is empty while the checkpoint is on disk), and this driver's specs of claims not
    /// recorded removed with their directories (a crash after the spec, before the record:
    /// the kubelet prepares the claim again). Returns (written, removed).
    pub async fn restore(&self) -> Result<(usize, usize), String> {
        let (checkpoint, cdi_dir, state_dir, nodes) = (self.checkpoint.clone(), self.cdi_dir.clone(), self.state_dir.clone(), self.nodes.clone());
        blocking(move || {
            let checkpoint = lock(&checkpoint);
            let mut written = 0;
            for prepared in checkpoint.claims() {
                // One claim's spec that cannot be written is that claim's problem: its
                // repeated prepare tries again; the others' are written, the driver serves.
                match cdi::write_in(&cdi_dir, &state_dir, &nodes, prepared) {
                    Ok((_, true)) => written += 1,
                    Ok((_, false)) => {}
                    Err(error) => tracing::error!(uid = %prepared.uid, "cannot restore a prepared claim's CDI spec: {error}"),
                }
            }
            let mut removed = 0;
            for uid in cdi::written_uids(&cdi_dir, &state_dir)? {
                if checkpoint.get(&uid).is_none() {
                    match cdi::remove(&cdi_dir, &state_dir, &uid) {
                        Ok(()) => removed += 1,
                        Err(error) => tracing::error!(%uid, "cannot remove the CDI spec of a claim not recorded: {error}"),
                    }
                }
            }
            Ok((written, removed))
        })
        .await
    }

    /// The checkpoint this preparer keeps, for a reader of the prepared claims beside it (the
    /// NRI side): lock it on the blocking pool only (a write holds it through an fsync).
    pub fn checkpoint(&self) -> Arc<Mutex<Checkpoint>> {
        self.checkpoint.clone()
    }

    /// Claims prepared now (the checkpoint's).
    pub async fn prepared_claims(&self) -> usize {
        let checkpoint = self.checkpoint.clone();
        blocking(move || Ok(lock(&checkpoint).claims().count())).await.unwrap_or(0)
    }

    /// Of the claims prepared now, those with admin access (no quota, counted against no GPU).
    pub async fn admin_access_claims(&self) -> usize {
        let checkpoint = self.checkpoint.clone();
        blocking(move || Ok(lock(&checkpoint).claims().filter(|c| c.shares.iter().any(|s| s.admin_access)).count())).await.unwrap_or(0)
    }

    /// Prepares one claim, within [`CLAIM_DEADLINE`].
    pub async fn prepare(&self, asked: &Asked) -> Result<Outcome, Refusal> {
        match tokio::time::timeout(CLAIM_DEADLINE, self.prepare_unbounded(asked)).await {
            Ok(outcome) => {
                if matches!(outcome, Ok(Outcome::Prepared(_))) {
                    self.tell_whole().await;
                }
                outcome
            }
            Err(_) => Err(refuse(
                Reason::Timeout,
                format!("claim {}/{} was not prepared within {CLAIM_DEADLINE:?} (the API server or the disk is slow)", asked.namespace, asked.name),
            )),
        }
    }

    async fn prepare_unbounded(&self, asked: &Asked) -> Result<Outcome, Refusal> {
        // Fail closed: the runtime creates a claim's containers once prepare answered, and
        // without the NRI side it would create them with the GPU and nothing behind the claim.
        if self.nri.as_ref().is_some_and(|connected| !*connected.borrow()) {
            return Err(refuse(
                Reason::NriDown,
                format!(
                    "claim {}/{}: the agent is not connected to the container runtime's NRI (off in its configuration, or reconnecting): \
                     its containers would get the GPU without their ledger and limit; the kubelet will ask again",
                    asked.namespace, asked.name
                ),
            ));
        }
        let (checkpoint, uid) = (self.checkpoint.clone(), asked.uid.clone());
        let (cdi_dir, state_dir, nodes) = (self.cdi_dir.clone(), self.state_dir.clone(), self.nodes.clone());
        let known = blocking(move || {
            let checkpoint = lock(&checkpoint);
            let Some(prepared) = checkpoint.get(&uid).cloned() else { return Ok(None) };
            // The runtime resolves the devices from the spec: it must be there before the answer.
            let (path, written) = cdi::write_in(&cdi_dir, &state_dir, &nodes, &prepared)?;
            if written {
                tracing::warn!(uid = %prepared.uid, spec = %path.display(), "a prepared claim's CDI spec was missing or different (a reboot empties the CDI directory): written again");
            }
            Ok(Some(prepared))
        })
        .await
        .map_err(|e| refuse(Reason::Write, e))?;
        if let Some(prepared) = known {
            return Ok(Outcome::Repeated(prepared));
        }
        let claim = match self.claims.get(&asked.namespace, &asked.name).await {
            Ok(Some(claim)) => claim,
            Ok(None) => return Err(refuse(Reason::NotFound, format!("claim {}/{} not found in the API server", asked.namespace, asked.name))),
            Err(error) => return Err(refuse(Reason::Api, format!("cannot get claim {}/{}: {error}", asked.namespace, asked.name))),
        };
        let Some(gpus) = self.gpus.borrow().clone() else {
            return Err(refuse(Reason::NoInventory, "the node's GPUs are not known yet (NVML has not answered, and there is no --gpu-memory): the kubelet will ask again".into()));
        };
        let prepared = shares_of(&claim, asked, &self.node, &gpus)?;
        let (checkpoint, cdi_dir, state_dir, nodes) = (self.checkpoint.clone(), self.cdi_dir.clone(), self.state_dir.clone(), self.nodes.clone());
        blocking(move || Ok(commit(&mut lock(&checkpoint), &gpus, &cdi_dir, &state_dir, &nodes, prepared)))
            .await
            .map_err(|e| refuse(Reason::Write, e))?
    }

    /// Unprepares one claim: its CDI spec and its record removed (a claim not recorded is
    /// unprepared already), then its ledger if no process of its containers is left, within
    /// [`CLAIM_DEADLINE`]. `Ok(false)`: it was not recorded.
    pub async fn unprepare(&self, asked: &Asked) -> Result<bool, String> {
        // The UID names files to remove: nothing that could leave their directories.
        if !is_uid(&asked.uid) {
            return Err(format!("claim {}/{}: {:?} is not a UID", asked.namespace, asked.name, asked.uid));
        }
        let (checkpoint, cdi_dir, state_dir, uid) = (self.checkpoint.clone(), self.cdi_dir.clone(), self.state_dir.clone(), asked.uid.clone());
        let unrecorded = blocking(move || {
            let mut checkpoint = lock(&checkpoint);
            let known = checkpoint.get(&uid).is_some();
            // The spec goes first: a claim whose spec cannot be removed stays recorded, so
            // that the kubelet's next try (or the next agent's) removes it.
            cdi::remove(&cdi_dir, &state_dir, &uid)?;
            die_at("unprepare-spec");
            checkpoint.remove(&uid)?;
            die_at("unprepare-forgotten");
            Ok(known)
        });
        let work = async {
            let known = unrecorded.await?;
            // Unrecorded first: no container of the claim can be created any more.
            if let Some(provisioner) = &self.ledgers {
                provisioner.release_claim(&asked.uid).await.map_err(|error| format!("claim {}/{}: {error}", asked.namespace, asked.name))?;
            }
            Ok(known)
        };
        match tokio::time::timeout(CLAIM_DEADLINE, work).await {
            Ok(done) => {
                self.tell_whole().await;
                done
            }
            Err(_) => Err(format!("claim {}/{} was not unprepared within {CLAIM_DEADLINE:?} (the disk is slow)", asked.namespace, asked.name)),
        }
    }
}

/// What a sweep for claims gone from the API server found ([`Preparer::sweep`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Swept {
    /// Entries dropped: their claim gone (404, or another UID) for the whole window.
    pub dropped: Vec<String>,
    /// Entries whose claim is gone, within the window still (the kubelet may unprepare them).
    pub waiting: usize,
    /// Claims the API server could not be asked about (nothing concluded).
    pub unknown: usize,
    /// Entries gone past the window kept because a container of the claim may still run: its
    /// memory is still held, so its share still counts (the claim was deleted from under a
    /// running pod, or a pod force-deleted while its kubelet was down).
    pub in_use: usize,
}

impl<C: Claims> Preparer<C> {
    /// Drops the checkpoint entries whose claim the API server no longer has (404, or a claim
    /// of the same name with another UID: deleted and made again) once it has been gone for
    /// `window` (`gone`: since when each was first seen gone; kept by the caller between
    /// sweeps): the kubelet unprepares a claim when its pods end, and a claim gone that long
    /// was never unprepared here (the kubelet was down, or lost it). Dropped as an unprepare
    /// drops it (spec, entry, ledger) only when no container of the claim may still run: one
    /// that may (the claim deleted from under its pod) keeps the entry, whose share of the
    /// GPU its memory still takes. An entry left would hold its share of the GPU
    /// for good, refusing new claims as `over_capacity`. A claim the API server cannot be
    /// asked about is left as it is.
    pub async fn sweep(&self, gone: &mut BTreeMap<String, std::time::Instant>, window: Duration) -> Swept {
        let checkpoint = self.checkpoint.clone();
        let recorded: Vec<Prepared> = blocking(move || Ok(lock(&checkpoint).claims().cloned().collect())).await.unwrap_or_default();
        gone.retain(|uid, _| recorded.iter().any(|p| &p.uid == uid));
        let mut swept = Swept::default();
        for prepared in recorded {
            let answer = tokio::time::timeout(CLAIM_DEADLINE, self.claims.get(&prepared.namespace, &prepared.name)).await;
            let missing = match answer {
                Ok(Ok(None)) => true,
                Ok(Ok(Some(claim))) => claim.metadata.uid.as_deref() != Some(prepared.uid.as_str()),
                Ok(Err(_)) | Err(_) => {
                    swept.unknown += 1;
                    continue;
                }
            };
            if !missing {
                gone.remove(&prepared.uid);
                continue;
            }
            let since = *gone.entry(prepared.uid.clone()).or_insert_with(std::time::Instant::now);
            if since.elapsed() < window {
                swept.waiting += 1;
                continue;
            }
            if let Some(provisioner) = &self.ledgers {
                let running = provisioner.claim_in_use(&prepared.uid).await;
                if !running.is_empty() {
                    tracing::warn!(uid = %prepared.uid, ?running, "dra: a prepared claim is gone from the API server but its containers may still run: kept (its share still counts)");
                    swept.in_use += 1;
                    continue;
                }
            }
            let asked = Asked { namespace: prepared.namespace.clone(), uid: prepared.uid.clone(), name: prepared.name.clone() };
            match self.unprepare(&asked).await {
                Ok(_) => {
                    tracing::warn!(claim = %format!("{}/{}", prepared.namespace, prepared.name), uid = %prepared.uid, gone_for = ?since.elapsed(), "dra: dropped a prepared claim the API server no longer has (the kubelet never unprepared it)");
                    gone.remove(&prepared.uid);
                    swept.dropped.push(prepared.uid);
                }
                Err(error) => tracing::warn!(uid = %prepared.uid, "dra: cannot drop a prepared claim gone from the API server: {error}"),
            }
        }
        swept
    }
}

/// Checks the capacity, writes the spec and records the claim: one step under the checkpoint's
/// lock, so that two claims cannot both take a GPU's last bytes.
fn commit(
    checkpoint: &mut Checkpoint,
    gpus: &Inventory,
    cdi_dir: &std::path::Path,
    state_dir: &std::path::Path,
    nodes: &cdi::Nodes,
    prepared: Prepared,
) -> Result<Outcome, Refusal> {
    if let Some(known) = checkpoint.get(&prepared.uid) {
        // Prepared meanwhile by another call for the same claim.
        return Ok(Outcome::Repeated(known.clone()));
    }
    // Admin-access shares are in no sum: they hold no memory of the GPU's (KEP-5018).
    let mut used: BTreeMap<u32, u64> = BTreeMap::new();
    for share in checkpoint.claims().flat_map(|c| &c.shares).filter(|share| !share.admin_access) {
        *used.entry(share.gpu).or_default() += share.memory;
    }
    for share in prepared.shares.iter().filter(|share| !share.admin_access) {
        let capacity = gpus.gpu(share.gpu).map_or(0, |gpu| gpu.capacity);
        let before = used.get(&share.gpu).copied().unwrap_or(0);
        let after = before.saturating_add(share.memory);
        if after > capacity {
            return Err(refuse(
                Reason::OverCapacity,
                format!(
                    "claim {}/{}: {} bytes on GPU {} would make its prepared claims {after} bytes, over its {capacity} bytes \
                     ({before} bytes prepared already): the allocation over-commits the GPU",
                    prepared.namespace, prepared.name, share.memory, share.gpu
                ),
            ));
        }
        used.insert(share.gpu, after);
    }
    cdi::write_in(cdi_dir, state_dir, nodes, &prepared).map_err(|e| refuse(Reason::Write, e))?;
    die_at("prepare-spec");
    if let Err(error) = checkpoint.insert(prepared.clone()) {
        // Not recorded: not prepared (the kubelet will try again).
        let _ = cdi::remove(cdi_dir, state_dir, &prepared.uid);
        return Err(refuse(Reason::Write, error));
    }
    die_at("prepare-recorded");
    Ok(Outcome::Prepared(prepared))
}

/// The claim's shares on this node's GPUs, checked: the claim the kubelet means (its UID),
/// allocated, each result of this driver in this node's pool one of its GPUs with the memory
/// it consumes (its `consumedCapacity.memory`, or without one the GPU's whole published
/// capacity: the scheduler gave it the device whole). Several results on one GPU (requests of
/// one claim) are several shares there, their sum the claim's quota on it. Results of other
/// drivers and other pools are not this driver's to prepare.
///
/// A result with `adminAccess` (KEP-5018: the API server allows it only in a namespace
/// labelled `resource.kubernetes.io/admin-access: "true"`, and the scheduler allocates it
/// ignoring the device's other allocations) is a share with no quota (`memory` 0, whatever
/// `consumedCapacity` says: the API does not say whether the scheduler records one for it,
/// and none of it is taken from the claims that hold the GPU), marked
/// [`Share::admin_access`]: its containers get the GPU's device node and no ledger, no limit
/// (monitoring). A claim that mixes admin-access and ordinary results is refused
/// ([`Reason::AdminAccess`]): its containers would get GPUs with a ledger and GPUs without.
pub fn shares_of(claim: &ResourceClaim, asked: &Asked, node: &str, gpus: &Inventory) -> Result<Prepared, Refusal> {
    let id = format!("{}/{}", asked.namespace, asked.name);
    let uid = claim.metadata.uid.as_deref().unwrap_or_default();
    if uid != asked.uid {
        return Err(refuse(Reason::UidChanged, format!("claim {id} has UID {uid:?}, the kubelet asked for {:?}", asked.uid)));
    }
    let Some(allocation) = claim.status.as_ref().and_then(|s| s.allocation.as_ref()) else {
        return Err(refuse(Reason::NotAllocated, format!("claim {id} (UID {uid}) is not allocated (no status.allocation)")));
    };
    let results = allocation.devices.as_ref().and_then(|d| d.results.as_deref()).unwrap_or_default();
    let mut shares: Vec<Share> = Vec::new();
    for result in results.iter().filter(|r| r.driver == DRIVER && r.pool == node) {
        let bad = |what: String| refuse(Reason::BadResult, format!("claim {id}: the result for request {:?} on device {:?}: {what}", result.request, result.device));
        let admin_access = result.admin_access == Some(true);
        let Some(gpu) = device_index(&result.device) else {
            return Err(bad(format!("not a device of {DRIVER} (gpu-<index>)")));
        };
        let Some(published) = gpus.gpu(gpu) else {
            let have: Vec<String> = gpus.gpus.iter().map(|g| super::device_name(g.index)).collect();
            return Err(bad(format!("GPU {gpu} is not on this node (its GPUs: {})", have.join(", "))));
        };
        let memory = match result.consumed_capacity.as_ref().and_then(|c| c.get(MEMORY)) {
            _ if admin_access => 0,
            Some(quantity) => parse_quantity(&quantity.0).ok_or_else(|| bad(format!("consumedCapacity.{MEMORY} {:?} is not a quantity of bytes", quantity.0)))?,
            // The scheduler records what a claim consumes only where the gate is on; without
            // it the device went to this claim whole.
            None => published.capacity,
        };
        shares.push(Share {
            request: result.request.clone(),
            pool: result.pool.clone(),
            device: result.device.clone(),
            gpu,
            share_id: result.share_id.clone(),
            memory,
            cdi_device: cdi::qualified(uid, gpu),
            admin_access,
        });
    }
    if shares.is_empty() {
        return Err(refuse(Reason::NoDevice, format!("claim {id} has no device of {DRIVER} allocated on node {node}")));
    }
    if shares.iter().any(|s| s.admin_access) && shares.iter().any(|s| !s.admin_access) {
        let admin: Vec<&str> = shares.iter().filter(|s| s.admin_access).map(|s| s.request.as_str()).collect();
        return Err(refuse(
            Reason::AdminAccess,
            format!("claim {id}: requests {admin:?} have admin access and the others a quota: a container of the claim would get GPUs without their ledger; ask for admin access in a claim of its own"),
        ));
    }
    Ok(Prepared { uid: uid.to_owned(), namespace: asked.namespace.clone(), name: asked.name.clone(), shares })
}

/// Whether `uid` has a UID's characters (the API server's are UUIDs).
fn is_uid(uid: &str) -> bool {
    !uid.is_empty() && uid.len() <= 128 && uid.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
}

/// The checkpoint, whatever a panicked holder left (its writes are all-or-nothing).
fn lock(checkpoint: &Mutex<Checkpoint>) -> std::sync::MutexGuard<'_, Checkpoint> {
    checkpoint.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// `work` on the blocking pool.
async fn blocking<T: Send + 'static>(work: impl FnOnce() -> Result<T, String> + Send + 'static) -> Result<T, String> {
    tokio::task::spawn_blocking(work).await.map_err(|e| format!("the blocking step failed: {e}"))?
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const NODE: &str = "node-1";
    const GIB: u64 = 1 << 30;

    /// The API server of the tests: claims by (namespace, name), and how many GETs it answered.
    #[derive(Default)]
    struct Fake {
        claims: Mutex<BTreeMap<(String, String), ResourceClaim>>,
        gets: std::sync::atomic::AtomicUsize,
    }

    impl Claims for Arc<Fake> {
        async fn get(&self, namespace: &str, name: &str) -> Result<Option<ResourceClaim>, String> {
            self.gets.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(self.claims.lock().expect("fake").get(&(namespace.to_owned(), name.to_owned())).cloned())
        }
    }

    fn claim(name: &str, uid: &str, results: Option<serde_json::Value>) -> ResourceClaim {
        let mut value = json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "team", "uid": uid},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.vramguard.io"}}]}},
        });
        if let Some(results) = results {
            value["status"] = json!({"allocation": {"devices": {"results": results}}});
        }
        serde_json::from_value(value).expect("a claim")
    }

    fn result(driver: &str, pool: &str, device: &str, memory: Option<&str>) -> serde_json::Value {
        let mut r = json!({"request": "gpu", "driver": driver, "pool": pool, "device": device, "shareID": "2f0c3a4e-0000-4000-8000-000000000001"});
        if let Some(memory) = memory {
            r["consumedCapacity"] = json!({"memory": memory});
        }
        r
    }

    /// A node of GPUs of these sizes (capacity the same), indexed from 0.
    fn gpus(sizes: &[u64]) -> Inventory {
        crate::inventory::from_flag(sizes, 0)
    }

    fn asked(name: &str, uid: &str) -> Asked {
        Asked { namespace: "team".into(), uid: uid.into(), name: name.into() }
    }

    fn tempdir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("vramguard-prepare-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        dir
    }

    fn preparer(tag: &str, sizes: Vec<u64>) -> (Preparer<Arc<Fake>>, Arc<Fake>, PathBuf) {
        let dir = tempdir(tag);
        let fake = Arc::new(Fake::default());
        let checkpoint = Checkpoint::open(&dir.join("state")).expect("checkpoint");
        let shared = crate::inventory::fixed(Some(gpus(&sizes)));
        (Preparer::new(fake.clone(), NODE.into(), shared, dir.join("cdi"), dir.join("state"), checkpoint), fake, dir)
    }

    fn put(fake: &Fake, claim: ResourceClaim) {
        let key = (claim.metadata.namespace.clone().unwrap_or_default(), claim.metadata.name.clone().unwrap_or_default());
        fake.claims.lock().expect("fake").insert(key, claim);
    }

    #[test]
    fn a_claim_re_created_under_the_same_name_is_refused_with_both_uids() {
        let c = claim("c", "uid-new", Some(json!([result(DRIVER, NODE, "gpu-0", Some("8Gi"))])));
        let refusal = shares_of(&c, &asked("c", "uid-old"), NODE, &gpus(&[80 * GIB])).expect_err("another UID");
        assert_eq!(refusal.reason, Reason::UidChanged);
        assert_eq!(refusal.message, r#"claim team/c has UID "uid-new", the kubelet asked for "uid-old""#);
    }

    #[test]
    fn a_claim_without_allocation_is_refused() {
        let refusal = shares_of(&claim("c", "u", None), &asked("c", "u"), NODE, &gpus(&[80 * GIB])).expect_err("not allocated");
        assert_eq!(refusal.reason, Reason::NotAllocated);
        assert!(refusal.message.contains("claim team/c (UID u) is not allocated"), "{}", refusal.message);
    }

    #[test]
    fn only_this_drivers_results_in_this_nodes_pool_are_shares() {
        let results = json!([
            result("other.example.com", NODE, "gpu-0", Some("1Gi")),
            result(DRIVER, "node-2", "gpu-0", Some("2Gi")),
            result(DRIVER, NODE, "gpu-1", Some("8Gi")),
        ]);
        let prepared = shares_of(&claim("c", "u", Some(results)), &asked("c", "u"), NODE, &gpus(&[80 * GIB, 80 * GIB])).expect("one share");
        assert_eq!(prepared.shares.len(), 1);
        let share = &prepared.shares[0];
        assert_eq!((share.gpu, share.memory, share.device.as_str(), share.pool.as_str()), (1, 8 * GIB, "gpu-1", NODE));
        assert_eq!(share.cdi_device, "gpu.vramguard.io/claim=u-gpu-1");
        assert_eq!(share.share_id.as_deref(), Some("2f0c3a4e-0000-4000-8000-000000000001"));
        // Only others' results: nothing of this driver to prepare.
        let others = json!([result("other.example.com", NODE, "gpu-0", Some("1Gi"))]);
        let refusal = shares_of(&claim("c", "u", Some(others)), &asked("c", "u"), NODE, &gpus(&[80 * GIB])).expect_err("none");
        assert_eq!(refusal.reason, Reason::NoDevice);
    }

    #[test]
    fn a_result_without_its_memory_has_the_gpu_whole_and_one_on_a_gpu_the_node_lacks_is_refused() {
        // As the API server leaves a result where DRAConsumableCapacity is off: no
        // consumedCapacity, no shareID. The scheduler gave the device whole.
        let mut whole = result(DRIVER, NODE, "gpu-1", None);
        whole.as_object_mut().expect("object").remove("shareID");
        let prepared = shares_of(&claim("c", "u", Some(json!([whole]))), &asked("c", "u"), NODE, &crate::inventory::from_flag(&[80 * GIB, 40 * GIB], GIB)).expect("the whole GPU");
        assert_eq!((prepared.shares[0].gpu, prepared.shares[0].memory, prepared.shares[0].share_id.as_deref()), (1, 39 * GIB, None), "its published capacity");
        // Minor numbers need not be dense: GPU 3 of a node whose GPUs are 0 and 3.
        let mut sparse = gpus(&[GIB; 4]);
        sparse.gpus.retain(|g| g.index == 0 || g.index == 3);
        assert!(shares_of(&claim("c", "u", Some(json!([result(DRIVER, NODE, "gpu-3", Some("1Gi"))]))), &asked("c", "u"), NODE, &sparse).is_ok());
        let refusal = shares_of(&claim("c", "u", Some(json!([result(DRIVER, NODE, "gpu-1", Some("1Gi"))]))), &asked("c", "u"), NODE, &sparse).expect_err("no GPU 1");
        assert!(refusal.message.contains("GPU 1 is not on this node (its GPUs: gpu-0, gpu-3)"), "{}", refusal.message);
        for (device, memory, says) in [("gpu-3", "1Gi", "GPU 3 is not on this node"), ("mig-0", "1Gi", "not a device of"), ("gpu-0", "lots", "not a quantity")] {
            let c = claim("c", "u", Some(json!([result(DRIVER, NODE, device, Some(memory))])));
            let refusal = shares_of(&c, &asked("c", "u"), NODE, &gpus(&[80 * GIB])).expect_err(device);
            assert_eq!(refusal.reason, Reason::BadResult);
            assert!(refusal.message.contains(says), "{}", refusal.message);
        }
    }

    #[tokio::test]
    async fn shares_past_a_gpus_memory_are_refused_and_the_rest_still_fits() {
        let (preparer, fake, dir) = preparer("capacity", vec![10 * GIB, 10 * GIB]);
        put(&fake, claim("a", "ua", Some(json!([result(DRIVER, NODE, "gpu-0", Some("6Gi"))]))));
        put(&fake, claim("b", "ub", Some(json!([result(DRIVER, NODE, "gpu-0", Some("5Gi"))]))));
        put(&fake, claim("c", "uc", Some(json!([result(DRIVER, NODE, "gpu-0", Some("4Gi"))]))));
        put(&fake, claim("d", "ud", Some(json!([result(DRIVER, NODE, "gpu-1", Some("5Gi"))]))));
        assert!(matches!(preparer.prepare(&asked("a", "ua")).await, Ok(Outcome::Prepared(_))));
        let refusal = preparer.prepare(&asked("b", "ub")).await.expect_err("6 + 5 > 10 GiB");
        assert_eq!(refusal.reason, Reason::OverCapacity);
        assert!(refusal.message.contains("over its 10737418240 bytes"), "{}", refusal.message);
        assert!(!cdi::spec_path(&dir.join("cdi"), "ub").exists(), "no spec for a refused claim");
        // Exactly full, and another GPU, still fit.
        assert!(matches!(preparer.prepare(&asked("c", "uc")).await, Ok(Outcome::Prepared(_))));
        assert!(matches!(preparer.prepare(&asked("d", "ud")).await, Ok(Outcome::Prepared(_))));
        assert_eq!(preparer.prepared_claims().await, 3);
        // Unpreparing frees the room.
        assert!(preparer.unprepare(&asked("a", "ua")).await.expect("unprepared"));
        assert!(matches!(preparer.prepare(&asked("b", "ub")).await, Ok(Outcome::Prepared(_))));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[tokio::test]
    async fn a_repeated_prepare_answers_the_same_without_the_api_server_and_unprepare_is_idempotent() {
        let (preparer, fake, dir) = preparer("repeat", vec![80 * GIB]);
        put(&fake, claim("a", "ua", Some(json!([result(DRIVER, NODE, "gpu-0", Some("8Gi"))]))));
        let first = preparer.prepare(&asked("a", "ua")).await.expect("prepared");
        assert!(matches!(first, Outcome::Prepared(_)));
        assert!(cdi::spec_path(&dir.join("cdi"), "ua").exists());
        // The claim gone from the API server: the checkpoint answers.
        fake.claims.lock().expect("fake").clear();
        let second = preparer.prepare(&asked("a", "ua")).await.expect("repeated");
        assert_eq!(second, Outcome::Repeated(first.prepared().clone()));
        assert_eq!(fake.gets.load(std::sync::atomic::Ordering::SeqCst), 1, "one GET only");
        // A restarted agent reads the same book.
        let again = Checkpoint::open(&dir.join("state")).expect("checkpoint");
        assert_eq!(again.get("ua"), Some(first.prepared()));
        assert!(preparer.unprepare(&asked("a", "ua")).await.expect("unprepared"));
        assert!(!cdi::spec_path(&dir.join("cdi"), "ua").exists());
        assert!(!preparer.unprepare(&asked("a", "ua")).await.expect("unknown: success"));
        assert!(Checkpoint::open(&dir.join("state")).expect("checkpoint").get("ua").is_none());
        // A UID that would name a path outside the driver's directories touches nothing.
        std::fs::create_dir_all(dir.join("state/dra/claims")).expect("claims dir");
        let error = preparer.unprepare(&asked("a", "../..")).await.expect_err("not a UID");
        assert_eq!(error, r#"claim team/a: "../.." is not a UID"#);
        assert!(dir.join("state/dra/checkpoint.json").exists() && dir.join("state/dra/claims").exists());
        let _ = std::fs::remove_dir_all(dir);
    }

    #[tokio::test]
    async fn after_a_reboot_emptied_the_cdi_directory_the_specs_are_written_again() {
        let (preparer, fake, dir) = preparer("reboot", vec![80 * GIB, 80 * GIB]);
        put(&fake, claim("a", "ua", Some(json!([result(DRIVER, NODE, "gpu-0", Some("8Gi"))]))));
        put(&fake, claim("b", "ub", Some(json!([result(DRIVER, NODE, "gpu-1", Some("8Gi"))]))));
        for (name, uid) in [("a", "ua"), ("b", "ub")] {
            assert!(matches!(preparer.prepare(&asked(name, uid)).await, Ok(Outcome::Prepared(_))));
        }
        let (spec_a, spec_b) = (cdi::spec_path(&dir.join("cdi"), "ua"), cdi::spec_path(&dir.join("cdi"), "ub"));
        let written = std::fs::read(&spec_a).expect("a's spec");
        // The reboot: /var/run/cdi is a tmpfs, the checkpoint is on disk.
        std::fs::remove_dir_all(dir.join("cdi")).expect("emptied");
        // The kubelet prepares again: answered from the checkpoint, the spec there first.
        assert!(matches!(preparer.prepare(&asked("a", "ua")).await, Ok(Outcome::Repeated(_))));
        assert_eq!(std::fs::read(&spec_a).expect("written again"), written);
        // A spec someone changed is made right; one that is right is left alone.
        std::fs::write(&spec_a, b"{}").expect("changed");
        assert!(matches!(preparer.prepare(&asked("a", "ua")).await, Ok(Outcome::Repeated(_))));
        assert_eq!(std::fs::read(&spec_a).expect("right again"), written);
        // At start (a new agent after the reboot), every recorded claim's spec, and an orphan
        // (a spec written before a crash, its claim never recorded) removed.
        assert!(!spec_b.exists(), "b not asked again yet");
        let orphan = Prepared { uid: "uo".into(), namespace: "team".into(), name: "o".into(), shares: Vec::new() };
        cdi::write_in(&dir.join("cdi"), &dir.join("state"), &cdi::Nodes::host(), &orphan).expect("orphan");
        assert_eq!(preparer.restore().await, Ok((1, 1)), "b's written, the orphan's removed, a's left");
        assert!(spec_b.exists() && !cdi::spec_path(&dir.join("cdi"), "uo").exists() && !cdi::claim_dir(&dir.join("state"), "uo").exists());
        assert_eq!(preparer.restore().await, Ok((0, 0)), "nothing more to do");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[tokio::test]
    async fn an_admin_access_result_is_prepared_without_a_quota_and_counts_against_no_gpu() {
        let (preparer, fake, dir) = preparer("admin", vec![10 * GIB]);
        // The GPU full: a claim of all of it.
        put(&fake, claim("a", "ua", Some(json!([result(DRIVER, NODE, "gpu-0", Some("10Gi"))]))));
        assert!(matches!(preparer.prepare(&asked("a", "ua")).await, Ok(Outcome::Prepared(_))));
        // Admin access with a consumedCapacity (shared device) and without (whole): both fit.
        let mut shared = result(DRIVER, NODE, "gpu-0", Some("1Gi"));
        shared["adminAccess"] = json!(true);
        let mut whole = result(DRIVER, NODE, "gpu-0", None);
        whole["adminAccess"] = json!(true);
        whole.as_object_mut().expect("object").remove("shareID");
        put(&fake, claim("m", "um", Some(json!([shared]))));
        put(&fake, claim("w", "uw", Some(json!([whole]))));
        for (name, uid) in [("m", "um"), ("w", "uw")] {
            let Ok(Outcome::Prepared(prepared)) = preparer.prepare(&asked(name, uid)).await else { panic!("{name} prepared") };
            assert_eq!(prepared.shares.iter().map(|s| (s.gpu, s.memory, s.admin_access)).collect::<Vec<_>>(), [(0, 0, true)]);
            assert!(cdi::spec_path(&dir.join("cdi"), uid).exists(), "its CDI spec: the GPU's device node");
        }
        assert_eq!((preparer.prepared_claims().await, preparer.admin_access_claims().await), (3, 2));
        assert!(preparer.held_whole().borrow().is_empty(), "an admin-access result holds no GPU whole");
        // Still full for an ordinary claim.
        put(&fake, claim("b", "ub", Some(json!([result(DRIVER, NODE, "gpu-0", Some("1Gi"))]))));
        assert_eq!(preparer.prepare(&asked("b", "ub")).await.map_err(|r| r.reason), Err(Reason::OverCapacity));
        // Admin access and a quota in one claim: refused, saying why.
        let mut admin = result(DRIVER, NODE, "gpu-0", None);
        admin["adminAccess"] = json!(true);
        admin["request"] = json!("watch");
        let mixed = claim("x", "ux", Some(json!([result(DRIVER, NODE, "gpu-0", Some("1Gi")), admin])));
        let refusal = shares_of(&mixed, &asked("x", "ux"), NODE, &gpus(&[80 * GIB])).expect_err("mixed");
        assert_eq!(refusal.reason, Reason::AdminAccess);
        assert!(refusal.message.contains(r#"requests ["watch"] have admin access"#), "{}", refusal.message);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[tokio::test]
    async fn two_requests_on_one_gpu_are_two_shares_summed_against_it() {
        let (preparer, fake, dir) = preparer("two-requests", vec![10 * GIB]);
        let mut second = result(DRIVER, NODE, "gpu-0", Some("3Gi"));
        second["request"] = json!("gpu-b");
        put(&fake, claim("a", "ua", Some(json!([result(DRIVER, NODE, "gpu-0", Some("6Gi")), second]))));
        let Ok(Outcome::Prepared(prepared)) = preparer.prepare(&asked("a", "ua")).await else { panic!("prepared") };
        assert_eq!(prepared.shares.iter().map(|s| (s.request.as_str(), s.gpu, s.memory)).collect::<Vec<_>>(), [("gpu", 0, 6 * GIB), ("gpu-b", 0, 3 * GIB)]);
        put(&fake, claim("b", "ub", Some(json!([result(DRIVER, NODE, "gpu-0", Some("2Gi"))]))));
        assert_eq!(preparer.prepare(&asked("b", "ub")).await.map_err(|r| r.reason), Err(Reason::OverCapacity), "9 GiB of 10 taken by a's two");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[tokio::test]
    async fn while_nri_is_not_connected_no_claim_is_prepared_not_even_again() {
        let (preparer, fake, dir) = preparer("nri-down", vec![80 * GIB]);
        let (connected_tx, connected) = watch::channel(true);
        let preparer = preparer.with_nri(Some(connected));
        put(&fake, claim("a", "ua", Some(json!([result(DRIVER, NODE, "gpu-0", Some("8Gi"))]))));
        assert!(matches!(preparer.prepare(&asked("a", "ua")).await, Ok(Outcome::Prepared(_))));
        connected_tx.send_replace(false);
        let refusal = preparer.prepare(&asked("a", "ua")).await.expect_err("NRI down");
        assert_eq!(refusal.reason, Reason::NriDown);
        assert!(refusal.message.contains("not connected to the container runtime's NRI"), "{}", refusal.message);
        connected_tx.send_replace(true);
        assert!(matches!(preparer.prepare(&asked("a", "ua")).await, Ok(Outcome::Repeated(_))));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[tokio::test]
    async fn before_the_node_s_gpus_are_known_a_claim_is_refused_for_the_kubelet_to_retry() {
        let dir = tempdir("no-inventory");
        let fake = Arc::new(Fake::default());
        let checkpoint = Checkpoint::open(&dir.join("state")).expect("checkpoint");
        let preparer = Preparer::new(fake.clone(), NODE.into(), crate::inventory::fixed(None), dir.join("cdi"), dir.join("state"), checkpoint);
        put(&fake, claim("a", "ua", Some(json!([result(DRIVER, NODE, "gpu-0", Some("1Gi"))]))));
        assert_eq!(preparer.prepare(&asked("a", "ua")).await.map_err(|r| r.reason), Err(Reason::NoInventory));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[tokio::test]
    async fn a_claim_gone_from_the_api_server_for_the_window_is_dropped_and_frees_its_share() {
        let (preparer, fake, dir) = preparer("sweep", vec![10 * GIB]);
        put(&fake, claim("a", "ua", Some(json!([result(DRIVER, NODE, "gpu-0", Some("8Gi"))]))));
        put(&fake, claim("b", "ub", Some(json!([result(DRIVER, NODE, "gpu-0", Some("1Gi"))]))));
        put(&fake, claim("c", "uc", Some(json!([result(DRIVER, NODE, "gpu-0", Some("4Gi"))]))));
        for (name, uid) in [("a", "ua"), ("b", "ub")] {
            assert!(matches!(preparer.prepare(&asked(name, uid)).await, Ok(Outcome::Prepared(_))));
        }
        assert_eq!(preparer.prepare(&asked("c", "uc")).await.map_err(|r| r.reason), Err(Reason::OverCapacity));
        let mut gone = BTreeMap::new();
        // Both there: nothing.
        assert_eq!(preparer.sweep(&mut gone, Duration::ZERO).await, Swept::default());
        // a deleted, b deleted and made again (another UID): gone, within the window.
        fake.claims.lock().expect("fake").remove(&("team".to_owned(), "a".to_owned()));
        put(&fake, claim("b", "ub-new", None));
        let swept = preparer.sweep(&mut gone, Duration::from_secs(3600)).await;
        assert_eq!((swept.dropped.len(), swept.waiting), (0, 2));
        assert!(cdi::spec_path(&dir.join("cdi"), "ua").exists(), "kept within the window");
        // The window passed: dropped as an unprepare drops them, and c fits.
        let swept = preparer.sweep(&mut gone, Duration::ZERO).await;
        assert_eq!(swept.dropped, ["ua", "ub"]);
        assert!(!cdi::spec_path(&dir.join("cdi"), "ua").exists() && preparer.prepared_claims().await == 0 && gone.is_empty());
        assert!(matches!(preparer.prepare(&asked("c", "uc")).await, Ok(Outcome::Prepared(_))));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[tokio::test]
    async fn a_claim_the_api_server_lacks_is_refused() {
        let (preparer, _fake, dir) = preparer("missing", vec![80 * GIB]);
        let refusal = preparer.prepare(&asked("gone", "ug")).await.expect_err("not found");
        assert_eq!(refusal.reason, Reason::NotFound);
        assert_eq!(refusal.message, "claim team/gone not found in the API server");
        let _ = std::fs::remove_dir_all(dir);
    }
}
