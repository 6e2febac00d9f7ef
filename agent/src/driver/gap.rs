//! Memory on a GPU that no row explains: the device's used memory (`nvmlDeviceGetMemoryInfo`)
//! less the sum of the figures NVML lists on it, less the driver's own reserve, less
//! [`PER_PROCESS`] for each process listed with a figure (the driver's memory beside each
//! process's row). NVML lists only processes with a channel, and rows may carry no figure, so
//! a driver client without a channel holds memory no row shows (docs/gpu.md); this is the
//! final check.
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
/// What the driver holds on a GPU for each process it lists, beyond the process's row, taken
/// off the gap: an H200 (driver 580) showed 8.81 MiB beside one process's primary context and
/// 14.38 MiB beside two processes' (docs/gpu.md, 2026-11-28). Without it the gap passed its
/// tolerance with about eight honest processes on one GPU, was alerted on, and was charged
/// to a container whose process held the device file unlisted (a forked child).
pub const PER_PROCESS: u64 = 16 << 20;
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
            let beside_rows = u64::from(device.processes).saturating_mul(PER_PROCESS);
            let unexplained = reserve.map(|r| used.saturating_sub(device.listed).saturating_sub(r).saturating_sub(beside_rows));
            let mut gap = Gap { reserve, unexplained, ..Gap::default() };
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

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn device(used: u64, listed: u64, processes: u32) -> DeviceMemory {
        DeviceMemory { memory: Some((80 << 30, used)), listed, processes, ..DeviceMemory::default() }
    }

    /// What the driver holds beside each listed process's row (8.81 MiB each, as an H200
    /// showed) is no gap with nine processes on one GPU (79 MiB: past the tolerance, were it
    /// counted); memory a client without a channel holds is, less what the listed processes
    /// are allowed.
    #[test]
    fn the_drivers_memory_beside_each_row_is_no_gap() {
        let (mut gaps, keys, listed) = (Gaps::default(), BTreeMap::new(), BTreeSet::new());
        let reserve = 615 * MIB;
        gaps.update(&mut [device(reserve, 0, 0)], &keys, &listed, 0);
        let (rows, beside) = (9 * 518 * MIB, 9 * (8810 * MIB / 1000));
        assert!(beside > TOLERANCE);
        let mut busy = [device(reserve + rows + beside, rows, 9)];
        gaps.update(&mut busy, &keys, &listed, 0);
        assert_eq!(busy[0].gap.unexplained, Some(0), "{:?}", busy[0].gap);
        let mut hidden = [device(reserve + rows + beside + 700 * MIB, rows, 9)];
        gaps.update(&mut hidden, &keys, &listed, 0);
        assert_eq!(hidden[0].gap.unexplained, Some(700 * MIB + beside - 9 * PER_PROCESS), "{:?}", hidden[0].gap);
    }
}
