//! A stand-in for the scheduler's DRA allocator (no kube-scheduler runs here): given the
//! ResourceSlices a driver published and a ResourceClaim, it allocates each of the claim's
//! requests as the scheduler does with consumable capacity (KEP-5075), and writes the claim's
//! `status` as the scheduler does.
//!
//! * Only the pools' current slices count: per pool, the slices of its highest generation, and
//!   only when all `resourceSliceCount` of them are there.
//! * A request (`spec.devices.requests[].exactly`, `ExactCount` of `count`) takes `count`
//!   distinct devices; on a shared device it consumes its `capacity.requests.memory` rounded
//!   by the device's published request policy ([`Range::consumed`], written here from the
//!   KEP's rules, not the agent's code): below `min` → `min`, up to the step, past `max` →
//!   not eligible, no request → the `default`.
//! * A shared device takes the request when the sum of what its shares consume stays at most
//!   its `memory` value (allocations of the device whole are not in that sum: the scheduler
//!   books dedicated and shared allocations apart); the first such device in the pools' order
//!   is chosen; none: the claim is unschedulable and nothing of it is allocated.
//! * The status: `allocation.devices.results[]` (`request`, `driver`, `pool`, `device`,
//!   `shareID` a fresh UUID, `consumedCapacity.memory`), `allocation.nodeSelector` (the
//!   node's name), `reservedFor` (the consumer).
//! * A device that does not allow multiple allocations (every device where the API server's
//!   `DRAConsumableCapacity` gate is off: it drops the field) goes whole to one claim: it is
//!   eligible only while no claim holds it, and its result has neither `shareID` nor
//!   `consumedCapacity` (the scheduler records those only for shared devices).
//! * A request with `adminAccess: true` (KEP-5018; the API server let it in only in a namespace
//!   labelled `resource.kubernetes.io/admin-access: "true"`, `kube_api::resource`) ignores the
//!   device's other allocations, as the API's field documentation states: it is allocated a
//!   device that other claims hold whole or fill, its result carries `adminAccess: true`, and
//!   it is booked against nothing (later claims still fit where they did). On a shared device
//!   its result has a `shareID` and a `consumedCapacity` like any other there: the API
//!   documents those as set for every allocation of such a device and says nothing apart for
//!   admin access, so the stand-in takes the reading that gives the driver the most to
//!   ignore (the driver must count it against nothing either way).
// Shared by several test files, each using part of it.
#![allow(dead_code)]
use std::collections::BTreeMap;

use ::agent::dra::{DRIVER, MEMORY};
use anyhow::{bail, Context, Result};
use k8s_openapi::api::resource::v1::ResourceSlice;
use serde_json::{json, Value};

/// A `validRange` request policy as published, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Range {
    pub min: u64,
    pub step: Option<u64>,
    pub max: Option<u64>,
    pub default: Option<u64>,
}

impl Range {
    /// What a request of `request` bytes (`None`: none) consumes on a device of `capacity`
    /// under this policy, as KEP-5075 states the scheduler's rounding: below `min`, `min`;
    /// with a step, `min` plus the excess rounded up to whole steps; past `max`, not
    /// eligible; no request, the `default` (the whole capacity without one).
    pub fn consumed(&self, capacity: u64, request: Option<u64>) -> Option<u64> {
        let Some(asked) = request else { return Some(self.default.unwrap_or(capacity)).filter(|&d| d <= capacity) };
        let rounded = match self.step {
            _ if asked <= self.min => self.min,
            Some(step) if step > 0 => self.min + (asked - self.min).div_ceil(step) * step,
            _ => asked,
        };
        (rounded <= self.max.unwrap_or(capacity) && rounded <= capacity).then_some(rounded)
    }
}

/// A device of a current pool.
#[derive(Clone, Debug)]
pub struct Device {
    pub pool: String,
    pub name: String,
    pub node: String,
    /// `capacity.memory.value` in bytes.
    pub capacity: u64,
    pub policy: Option<Range>,
    /// Allows multiple allocations (else: one claim at a time, whole).
    pub shared: bool,
}

/// One result the allocator made: the device (pool, name), and what it consumes there if the
/// device was shared (`None`: allocated whole, dedicated).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Taken {
    pool: String,
    device: String,
    shared: Option<u64>,
    /// Admin access: in no book.
    admin: bool,
}

/// The allocator's book: the current devices and what each claim holds of them.
#[derive(Debug, Default)]
pub struct Allocator {
    pub devices: Vec<Device>,
    /// Claim UID → its results.
    allocated: BTreeMap<String, Vec<Taken>>,
}

/// Why a claim was not allocated.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    /// No device (or not `count` devices) with room for one of its requests.
    Unschedulable { request: String },
}

fn bytes(text: &str, what: &str) -> Result<u64> {
    ::agent::provision::kube::parse_quantity(text).with_context(|| format!("{what}: {text:?} is not a quantity of bytes"))
}

impl Allocator {
    /// The devices of `slices` (JSON as the API server serves them) that belong to this
    /// driver's current pools.
    pub fn new(slices: &[Value]) -> Result<Allocator> {
        let mut allocator = Allocator::default();
        allocator.refresh(slices)?;
        Ok(allocator)
    }

    /// The pools as now published (`slices`), the allocations kept (by pool and device name:
    /// the scheduler's book of allocated claims outlives a republished pool).
    pub fn refresh(&mut self, slices: &[Value]) -> Result<()> {
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
                    let capacity = bytes(&memory.value.0, &format!("{pool}/{}: capacity", device.name))?;
                    let policy = match &memory.request_policy {
                        None => None,
                        Some(policy) => {
                            let range = policy.valid_range.as_ref().context("only validRange policies are allocated here")?;
                            Some(Range {
                                min: bytes(&range.min.0, "min")?,
                                step: range.step.as_ref().map(|q| bytes(&q.0, "step")).transpose()?,
                                max: range.max.as_ref().map(|q| bytes(&q.0, "max")).transpose()?,
                                default: policy.default.as_ref().map(|q| bytes(&q.0, "default")).transpose()?,
                            })
                        }
                    };
                    devices.push(Device { pool: pool.clone(), name: device.name.clone(), node: slice.spec.node_name.clone().unwrap_or_default(), capacity, policy, shared });
                }
            }
        }
        self.devices = devices;
        Ok(())
    }

    fn results_on(&self, index: usize) -> impl Iterator<Item = &Taken> {
        let device = &self.devices[index];
        self.allocated.values().flatten().filter(move |t| !t.admin && t.pool == device.pool && t.device == device.name)
    }

    /// What the shares allocated now consume on device `index` (dedicated allocations are not
    /// in this sum: the scheduler keeps the two apart).
    pub fn used(&self, index: usize) -> u64 {
        self.results_on(index).filter_map(|t| t.shared).sum()
    }

    /// Whether device `index` is allocated whole (dedicated) to a claim.
    pub fn dedicated(&self, index: usize) -> bool {
        self.results_on(index).any(|t| t.shared.is_none())
    }

    /// What a request of `request` bytes (`None`: no request) consumes on device `index`, if
    /// the device is eligible for it (its room aside).
    pub fn consumed(&self, index: usize, request: Option<u64>) -> Option<u64> {
        let device = self.devices.get(index)?;
        if !device.shared {
            // Whole: a request is a selection only (at most the capacity).
            return (request.unwrap_or(0) <= device.capacity).then_some(device.capacity);
        }
        match &device.policy {
            Some(policy) => policy.consumed(device.capacity, request),
            None => Some(request.unwrap_or(device.capacity)).filter(|&r| r <= device.capacity),
        }
    }

    /// Allocates `claim` (a ResourceClaim as JSON) for `consumer` (`{resource, name, uid}`):
    /// the claim with its `status` written, or why not (nothing allocated then). Each request
    /// (`exactly`, `ExactCount` of `count`) gets `count` distinct devices, first fit in the
    /// pools' order: a shared device while the sum of the shares on it stays within its
    /// capacity (several requests of one claim may share it, each its own `shareID`); a
    /// device that is not shared while no claim has it (not twice in one claim either).
    pub fn allocate(&mut self, claim: &Value, consumer: &Value) -> Result<std::result::Result<Value, Refused>> {
        let uid = claim["metadata"]["uid"].as_str().context("the claim has no uid")?.to_owned();
        if self.allocated.contains_key(&uid) {
            bail!("claim {uid} is allocated already");
        }
        let requests = claim["spec"]["devices"]["requests"].as_array().context("the claim has no requests")?;
        // (device, what a share consumes, admin access)
        let mut taken: Vec<(usize, Option<u64>, bool)> = Vec::new();
        let mut results = Vec::new();
        for request in requests {
            let name = request["name"].as_str().context("a request without a name")?;
            let exactly = &request["exactly"];
            if exactly["allocationMode"].as_str().unwrap_or("ExactCount") != "ExactCount" {
                bail!("request {name}: only ExactCount is allocated here");
            }
            let count = exactly["count"].as_u64().unwrap_or(1);
            let admin = exactly["adminAccess"] == true;
            let asked = match &exactly["capacity"]["requests"][MEMORY] {
                Value::Null => None,
                Value::String(q) => Some(bytes(q, &format!("request {name}: memory"))?),
                other => bail!("request {name}: memory {other} is not a quantity"),
            };
            let mut mine: Vec<usize> = Vec::new();
            for _ in 0..count {
                let room = |index: usize| -> Option<u64> {
                    if mine.contains(&index) {
                        return None; // distinct devices within a request
                    }
                    let consumed = self.consumed(index, asked)?;
                    if admin {
                        return Some(consumed); // whatever else holds the device
                    }
                    let device = &self.devices[index];
                    let ordinary = |d: &usize, a: &bool| *d == index && !*a;
                    if !device.shared {
                        let free = !self.dedicated(index) && self.used(index) == 0 && !taken.iter().any(|(d, _, a)| ordinary(d, a));
                        return free.then_some(consumed);
                    }
                    let pending: u64 = taken.iter().filter(|(d, _, a)| ordinary(d, a)).filter_map(|(_, b, _)| *b).sum();
                    (self.used(index) + pending + consumed <= device.capacity).then_some(consumed)
                };
                let Some((index, consumed)) = (0..self.devices.len()).find_map(|i| room(i).map(|c| (i, c))) else {
                    return Ok(Err(Refused::Unschedulable { request: name.to_owned() }));
                };
                let device = &self.devices[index];
                let shared = device.shared.then_some(consumed);
                taken.push((index, shared, admin));
                mine.push(index);
                let mut result = json!({"request": name, "driver": DRIVER, "pool": device.pool, "device": device.name});
                if admin {
                    result["adminAccess"] = json!(true);
                }
                if device.shared {
                    result["shareID"] = json!(share_id()?);
                    result["consumedCapacity"] = json!({MEMORY: consumed.to_string()});
                }
                results.push(result);
            }
        }
        let node = taken.first().map(|(d, _, _)| self.devices[*d].node.clone()).unwrap_or_default();
        let book = taken.iter().map(|(d, shared, admin)| Taken { pool: self.devices[*d].pool.clone(), device: self.devices[*d].name.clone(), shared: *shared, admin: *admin }).collect();
        self.allocated.insert(uid, book);
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
