//! A stand-in for the scheduler's DRA allocator (no kube-scheduler runs here): given the
//! ResourceSlices a driver published and a ResourceClaim, it allocates each of the claim's
//! requests as the scheduler does with consumable capacity (KEP-5075), and writes the claim's
//! `status` as the scheduler does.
//!
//! * Only the pools' current slices count: per pool, the slices of its highest generation, and
//!   only when all `resourceSliceCount` of them are there.
//! * A request (`spec.devices.requests[].exactly`, `ExactCount` of 1) consumes, on a device of
//!   the driver, its `capacity.requests.memory` rounded by the device's request policy with
//!   the agent's own function ([`::agent::dra::policy::Policy::consumed`]): below `min` → `min`,
//!   up to the step, past `max` → not eligible, no request → the `default`.
//! * A device takes the request when the sum of what its claims consume stays at most its
//!   `memory` value; the first such device in the pools' order is chosen; none: the claim is
//!   unschedulable and nothing of it is allocated.
//! * The status: `allocation.devices.results[]` (`request`, `driver`, `pool`, `device`,
//!   `shareID` a fresh UUID, `consumedCapacity.memory`), `allocation.nodeSelector` (the
//!   node's name), `reservedFor` (the consumer).
//! * A device that does not allow multiple allocations (every device where the API server's
//!   `DRAConsumableCapacity` gate is off: it drops the field) goes whole to one claim: it is
//!   eligible only while no claim holds it, and its result has neither `shareID` nor
//!   `consumedCapacity` (the scheduler records those only for shared devices).
// Shared by several test files, each using part of it.
#![allow(dead_code)]
use std::collections::BTreeMap;

use ::agent::dra::{policy::Policy, DRIVER, MEMORY};
use anyhow::{bail, Context, Result};
use k8s_openapi::api::resource::v1::ResourceSlice;
use serde_json::{json, Value};

/// A device of a current pool.
#[derive(Clone, Debug)]
pub struct Device {
    pub pool: String,
    pub name: String,
    pub node: String,
    /// `capacity.memory.value` in bytes.
    pub capacity: u64,
    pub policy: Option<Policy>,
    /// Allows multiple allocations (else: one claim at a time, whole).
    pub shared: bool,
}

/// The allocator's book: the current devices and what each claim consumes on them.
#[derive(Debug, Default)]
pub struct Allocator {
    pub devices: Vec<Device>,
    /// Claim UID → (device index, bytes) per result.
    allocated: BTreeMap<String, Vec<(usize, u64)>>,
}

/// Why a claim was not allocated.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    /// No device with room for one of its requests.
    Unschedulable { request: String },
}

impl Allocator {
    /// The devices of `slices` (JSON as the API server serves them) that belong to this
    /// driver's current pools.
    pub fn new(slices: &[Value]) -> Result<Allocator> {
        let slices: Vec<ResourceSlice> = slices.iter().map(|s| serde_json::from_value(s.clone())).collect::<Result<_, _>>().context("a ResourceSlice")?;
        let mut pools: BTreeMap<String, Vec<&ResourceSlice>> = BTreeMap::new();
        for slice in slices.iter().filter(|s| s.spec.driver == DRIVER) {
            pools.entry(slice.spec.pool.name.clone()).or_default().push(slice);
        }
        let mut devices = Vec::new();
        for (pool, slices) in pools {
            let Some(generation) = slices.iter().map(|s| s.spec.pool.generation).max() else { continue };
            let current: Vec<_> = slices.into_iter().filter(|s| s.spec.pool.generation == generation).collect();
            if current.iter().any(|s| s.spec.pool.resource_slice_count != current.len() as i64) {
                continue; // incomplete: the scheduler waits for the rest
            }
            for slice in current {
                for device in slice.spec.devices.iter().flatten() {
                    let Some(memory) = device.capacity.as_ref().and_then(|c| c.get(MEMORY)) else { continue };
                    let shared = device.allow_multiple_allocations == Some(true);
                    let capacity = ::agent::provision::kube::parse_quantity(&memory.value.0).with_context(|| format!("{pool}/{}: capacity {:?}", device.name, memory.value.0))?;
                    let policy = memory.request_policy.as_ref().map(Policy::from_api).transpose().map_err(anyhow::Error::msg)?;
                    devices.push(Device { pool: pool.clone(), name: device.name.clone(), node: slice.spec.node_name.clone().unwrap_or_default(), capacity, policy, shared });
                }
            }
        }
        Ok(Allocator { devices, allocated: BTreeMap::new() })
    }

    /// What the claims allocated now consume on device `index`.
    pub fn used(&self, index: usize) -> u64 {
        self.allocated.values().flatten().filter(|(d, _)| *d == index).map(|(_, b)| b).sum()
    }

    /// What a request of `request` bytes (`None`: no request) consumes on device `index`, if
    /// the device is eligible for it.
    pub fn consumed(&self, index: usize, request: Option<u64>) -> Option<u64> {
        let device = self.devices.get(index)?;
        if !device.shared {
            // Whole: the request (if any) is only a selection: at most the capacity.
            return (request.unwrap_or(0) <= device.capacity && self.used(index) == 0).then_some(device.capacity);
        }
        match &device.policy {
            Some(policy) => policy.consumed(device.capacity, request),
            None => Some(request.unwrap_or(device.capacity)).filter(|&r| r <= device.capacity),
        }
    }

    /// Allocates `claim` (a ResourceClaim as JSON) for `consumer` (`{resource, name, uid}`):
    /// the claim with its `status` written, or why not (nothing allocated then).
    pub fn allocate(&mut self, claim: &Value, consumer: &Value) -> Result<std::result::Result<Value, Refused>> {
        let uid = claim["metadata"]["uid"].as_str().context("the claim has no uid")?.to_owned();
        if self.allocated.contains_key(&uid) {
            bail!("claim {uid} is allocated already");
        }
        let requests = claim["spec"]["devices"]["requests"].as_array().context("the claim has no requests")?;
        let mut taken: Vec<(usize, u64)> = Vec::new();
        let mut results = Vec::new();
        for request in requests {
            let name = request["name"].as_str().context("a request without a name")?;
            let exactly = &request["exactly"];
            if exactly["allocationMode"].as_str().unwrap_or("ExactCount") != "ExactCount" || exactly["count"].as_u64().unwrap_or(1) != 1 {
                bail!("request {name}: only ExactCount of 1 is allocated here");
            }
            let asked = match &exactly["capacity"]["requests"][MEMORY] {
                Value::Null => None,
                Value::String(q) => Some(::agent::provision::kube::parse_quantity(q).with_context(|| format!("request {name}: memory {q:?}"))?),
                other => bail!("request {name}: memory {other} is not a quantity"),
            };
            let room = |index: usize, allocator: &Allocator, taken: &[(usize, u64)]| {
                let consumed = allocator.consumed(index, asked)?;
                let used = allocator.used(index) + taken.iter().filter(|(d, _)| *d == index).map(|(_, b)| b).sum::<u64>();
                (used + consumed <= allocator.devices[index].capacity).then_some(consumed)
            };
            let Some((index, consumed)) = (0..self.devices.len()).find_map(|i| room(i, self, &taken).map(|c| (i, c))) else {
                return Ok(Err(Refused::Unschedulable { request: name.to_owned() }));
            };
            taken.push((index, consumed));
            let device = &self.devices[index];
            let mut result = json!({"request": name, "driver": DRIVER, "pool": device.pool, "device": device.name});
            if device.shared {
                result["shareID"] = json!(share_id()?);
                result["consumedCapacity"] = json!({MEMORY: consumed.to_string()});
            }
            results.push(result);
        }
        let node = taken.first().map(|(d, _)| self.devices[*d].node.clone()).unwrap_or_default();
        self.allocated.insert(uid, taken);
        let mut claim = claim.clone();
        claim["status"] = json!({
            "allocation": {
                "devices": {"results": results},
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}
            },
            "reservedFor": [consumer]
        });
        Ok(Ok(claim))
    }

    /// Forgets claim `uid`'s allocation (the claim was deleted or deallocated).
    pub fn release(&mut self, uid: &str) -> bool {
        self.allocated.remove(uid).is_some()
    }
}

/// A random UUID (version 4), as the scheduler's `shareID`.
fn share_id() -> Result<String> {
    let mut b = [0u8; 16];
    std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom")?, &mut b)?;
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    Ok(format!("{}-{}-{}-{}-{}", &hex[0..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..32]))
}

/// A ResourceClaim asking one device of `gpu.vramguard.io` with `memory` (a quantity; `None`:
/// no capacity request), as a claim made from the shipped template is.
pub fn claim(namespace: &str, name: &str, uid: &str, memory: Option<&str>) -> Value {
    let mut exactly = json!({"deviceClassName": DRIVER, "allocationMode": "ExactCount", "count": 1});
    if let Some(memory) = memory {
        exactly["capacity"] = json!({"requests": {MEMORY: memory}});
    }
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"namespace": namespace, "name": name, "uid": uid},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}
    })
}
