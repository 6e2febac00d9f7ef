//! The prepared claims: the contract between the DRA driver ([`crate::dra`], which prepares
//! claims for the kubelet) and the NRI side ([`crate::provision::claim`], which provisions a
//! claim's containers from them): the names both use, a prepared claim and its shares, the
//! checkpoint that keeps them ([`checkpoint`]) and each claim's CDI spec ([`cdi`]). Below both
//! rooms: it names nothing of either.
use serde::{Deserialize, Serialize};

pub mod cdi;
pub mod checkpoint;


/// The driver's name: the ResourceSlices' `spec.driver`, the kubelet plugin's name, the
/// allocation results' `driver`, the CDI spec's vendor.
pub const DRIVER: &str = "gpu.vramguard.io";

/// The capacity a claim consumes on a GPU, as the scheduler records it in
/// `consumedCapacity` and the ResourceSlice names it.
pub const MEMORY: &str = "memory";

/// The name of GPU `index`'s device in the node's ResourceSlice pool (`gpu-0`, `gpu-1`, …):
/// the index is the driver's minor number, the one `--gpu-memory` counts in and the one
/// `/dev/nvidia<N>` carries.
pub fn device_name(index: u32) -> String {
    format!("gpu-{index}")
}

/// The GPU index a device name of this driver's pool names; `None` for any other name.
pub fn device_index(name: &str) -> Option<u32> {
    let digits = name.strip_prefix("gpu-")?;
    // `gpu-01` or `gpu-+1` would parse; only the canonical spelling names a GPU.
    let index: u32 = digits.parse().ok()?;
    (device_name(index) == name).then_some(index)
}

/// A claim the driver prepared: the kubelet's identity of it and its shares on this node's
/// GPUs, as the checkpoint keeps it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Prepared {
    /// `metadata.uid` of the ResourceClaim: the key of every call and of the checkpoint.
    pub uid: String,
    pub namespace: String,
    pub name: String,
    /// One per allocation result of this driver, in the allocation's order.
    pub shares: Vec<Share>,
}

/// One allocation result of a prepared claim: a share of one GPU's memory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Share {
    /// The claim's request the result answers (`results[].request`).
    pub request: String,
    /// The ResourceSlice pool and device (`results[].pool`, `results[].device`).
    pub pool: String,
    pub device: String,
    /// The GPU's index ([`device_index`] of `device`).
    pub gpu: u32,
    /// `results[].shareID`: set by the scheduler for a device that allows multiple allocations.
    pub share_id: Option<String>,
    /// `results[].consumedCapacity.memory` in bytes: the quota on that GPU.
    pub memory: u64,
    /// The fully qualified CDI device name returned to the kubelet (`<vendor>/<class>=<name>`).
    pub cdi_device: String,
    /// `results[].adminAccess`: the device was allocated for administrative access (KEP-5018:
    /// monitoring, beside the claims that hold it). Such a share has no quota (`memory` 0)
    /// and is counted against no GPU; absent from checkpoints written before it: false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub admin_access: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_round_trip_and_only_canonical_names_name_a_gpu() {
        for index in [0, 1, 7, 127] {
            assert_eq!(device_index(&device_name(index)), Some(index));
        }
        for other in ["gpu-", "gpu-01", "gpu-+1", "gpu--1", "gpu-1x", "GPU-1", "mig-1", "gpu-4294967296"] {
            assert_eq!(device_index(other), None, "{other}");
        }
    }
}
