//! Memory on a GPU that no row explains: the device's used memory (`nvmlDeviceGetMemoryInfo`)
//! less the sum of the figures NVML lists on it less the driver's own reserve. NVML lists only
//! processes with a channel, and rows may carry no figure, so a driver client without a
//! channel holds memory no row shows (docs/gpu.md); this is the final check.
//!
//! The reserve is measured, not assumed: at a read that lists no process on the GPU, when no
//! process but the agent holds the GPU's device file ([`super::holders`], one scan of `/proc`
//! within [`SCAN_BUDGET`], made only when the used memory differs from the reserve last
//! measured), the used memory is the reserve. Where the GPU's device file cannot be found the
//! reserve is taken at a read listing no process. Until it is measured, no gap is given.
//!
//! A gap above [`TOLERANCE`] is looked into: the processes holding the GPU's device file that
//! NVML does not list (one scan of `/proc` per read while the gap lasts, within
//! [`SCAN_BUDGET`]) and their cgroups. When they are all in one cgroup the gap is attributed
//! to it (its container's ledger is charged with it, [`crate::reconcile`]); holders in several
//! cgroups leave it unattributed, with the holders reported (`vramguard audit`), and the gap
//! is exported and alerted on either way (`vramguard_device_unexplained_bytes`).
use std::{
    collections::{BTreeMap, BTreeSet},
    time::Duration,
};

use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use super::{
    holders::{self, FileKey},
    DeviceMemory,
};

/// Unexplained memory below this is reported but neither looked into nor charged (64 MiB,
/// the reconcile's drift threshold).
pub const TOLERANCE: u64 = 64 << 20;
/// Time one scan of `/proc` for a GPU's holders may take (a scan of 1,000 processes takes
/// a few milliseconds, docs/BENCHMARKS.md). A scan cut short that found no holder keeps the
/// holders the last complete one found while the gap lasts.
pub const SCAN_BUDGET: Duration = Duration::from_millis(200);

/// A process holding a GPU's device file that NVML does not list.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holder {
    pub pid: u32,
    /// Its cgroup (0 when it could not be read).
    pub cgroup_id: u64,
}

/// What the last read found of a GPU's unexplained memory.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gap {
    /// The driver's own reserve, as measured with no process on the GPU.
    #[serde(default)]
    pub reserve: Option<u64>,
    /// used − Σ rows − reserve (none until the reserve is measured).
    #[serde(default)]
    pub unexplained: Option<u64>,
    /// The unlisted holders of its device file, when the gap is above the tolerance.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub holders: Vec<Holder>,
    /// The cgroup the gap is attributed to (all unlisted holders in it).
    #[serde(default)]
    pub cgroup_id: Option<u64>,
    /// The scan ran out of its budget (holders may be missing).
    #[serde(default)]
    pub incomplete: bool,
}

/// The reserves measured so far, by GPU index.
#[derive(Debug, Default)]
pub struct Gaps {
    reserves: BTreeMap<u32, u64>,
    /// GPUs whose gap above the tolerance was logged, with the cgroup said then.
    said: BTreeMap<u32, Option<u64>>,
    /// The last gap found above the tolerance on each GPU.
    last: BTreeMap<u32, Gap>,
}

impl Gaps {
    /// Fills each device's [`Gap`]: `keys` are the GPUs' device files by minor number,
    /// `listed` every pid NVML listed (on any GPU, with a figure or not), `me` the agent.
    pub fn update(&mut self, devices: &mut [DeviceMemory], keys: &BTreeMap<u32, Option<FileKey>>, listed: &BTreeSet<u32>, me: u32) {
        for device in devices {
            let Some((_, used)) = device.memory else { continue };
            let key = keys.get(&device.minor).copied().flatten();
            let idle = device.listed == 0 && device.unfigured == 0;
            if idle && self.reserves.get(&device.index) != Some(&used) {
                let nobody = match key {
                    Some(key) => {
                        let scan = holders::scan(&[key], me, SCAN_BUDGET);
                        !scan.incomplete && scan.holders.is_empty()
                    }
                    None => true,
                };
                if nobody {
                    info!(gpu = device.index, reserve = used, "driver view: the driver's own reserve measured with no process on the GPU");
                    self.reserves.insert(device.index, used);
                }
            }
            let reserve = self.reserves.get(&device.index).copied();
            let mut gap = Gap { reserve, unexplained: reserve.map(|r| used.saturating_sub(device.listed).saturating_sub(r)), ..Gap::default() };
            if let (Some(unexplained), Some(key)) = (gap.unexplained, key) {
                if unexplained > TOLERANCE {
                    let scan = holders::scan(&[key], me, SCAN_BUDGET);
                    gap.incomplete = scan.incomplete;
                    gap.holders = scan
                        .holders
                        .into_iter()
                        .filter(|(pid, _)| !listed.contains(pid))
                        .map(|(pid, _)| Holder { pid, cgroup_id: crate::cgroup::id_of_pid(pid).unwrap_or(0) })
                        .collect();
                    if gap.incomplete && gap.holders.is_empty() {
                        if let Some(last) = self.last.get(&device.index) {
                            gap.holders = last.holders.clone();
                        }
                    }
                    let cgroups: BTreeSet<u64> = gap.holders.iter().map(|h| h.cgroup_id).collect();
                    gap.cgroup_id = match cgroups.into_iter().collect::<Vec<_>>()[..] {
                        [only] if only != 0 => Some(only),
                        _ => None,
                    };
                    if self.said.insert(device.index, gap.cgroup_id) != Some(gap.cgroup_id) {
                        warn!(gpu = device.index, unexplained, holders = ?gap.holders, cgroup_id = ?gap.cgroup_id, "driver view: GPU memory that no process NVML lists explains");
                    }
                    self.last.insert(device.index, gap.clone());
                } else {
                    self.said.remove(&device.index);
                    self.last.remove(&device.index);
                }
            }
            device.gap = gap;
        }
    }
}
