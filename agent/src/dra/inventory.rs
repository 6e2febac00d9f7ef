//! The node's GPUs as the ResourceSlice pool lists them: each GPU's index (its minor number:
//! the device name `gpu-<N>` and `/dev/nvidia<N>`), UUID, product, memory, and the `memory`
//! capacity claims may share (the memory less the driver's reserve, `--dra-memory-reserve`).
//!
//! Where from: the driver view's last good NVML read ([`crate::driver`]): every GPU it lists
//! with a memory figure. A GPU NVML stops listing (removed from the bus) leaves the
//! inventory at the next read; a read that fails or hangs changes nothing (a GPU is not gone
//! because NVML did not answer: health is the DRA plugin's to report). Where the node has no
//! NVML (`absent`), `--gpu-memory` is a fake inventory, one GPU per value: no UUID, product
//! `unknown`, and the attribute `source: gpu-memory` says so on every device.
use crate::driver::{DriverView, State};

/// Where the inventory came from (the devices' `source` attribute).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    Nvml,
    /// `--gpu-memory`, on a node without NVML.
    Flag,
}

impl Source {
    pub fn name(self) -> &'static str {
        match self {
            Source::Nvml => "nvml",
            Source::Flag => "gpu-memory",
        }
    }
}

/// One GPU of the pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gpu {
    /// The minor number.
    pub index: u32,
    /// NVML's `GPU-…`; `None` without one (the fake inventory).
    pub uuid: Option<String>,
    pub product: String,
    /// The GPU's memory (NVML's total).
    pub memory: u64,
    /// What claims may share: the memory less the reserve.
    pub capacity: u64,
}

/// The node's GPUs, by index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Inventory {
    pub source: Source,
    pub gpus: Vec<Gpu>,
}

/// The product of a GPU whose product nobody said.
pub const UNKNOWN_PRODUCT: &str = "unknown";

/// The inventory the driver `view` gives, if it gives one: `Some` after a good read (every
/// GPU with a memory figure; GPUs sharing a minor number once), with `--gpu-memory`
/// (`flag`) when NVML is absent; `None` while the view says nothing new about the GPUs
/// (starting, failing, hung, or absent with no flag): keep what was published.
pub fn from_view(view: &DriverView, flag: &[u64], reserve: u64) -> Option<Inventory> {
    match view.status.state {
        State::Ok => {
            let mut gpus: Vec<Gpu> = view
                .status
                .devices
                .iter()
                .filter_map(|device| {
                    let (total, _) = device.memory?;
                    Some(Gpu {
                        index: device.minor,
                        uuid: (!device.uuid.is_empty()).then(|| device.uuid.clone()),
                        product: if device.name.is_empty() { UNKNOWN_PRODUCT.into() } else { device.name.clone() },
                        memory: total,
                        capacity: total.saturating_sub(reserve),
                    })
                })
                .collect();
            gpus.sort_by_key(|gpu| gpu.index);
            gpus.dedup_by_key(|gpu| gpu.index);
            Some(Inventory { source: Source::Nvml, gpus })
        }
        State::Absent if !flag.is_empty() => Some(from_flag(flag, reserve)),
        State::Absent | State::Starting | State::Failing | State::Hung => None,
    }
}

/// The fake inventory of `--gpu-memory`: GPU `i` has `flag[i]` bytes.
pub fn from_flag(flag: &[u64], reserve: u64) -> Inventory {
    let gpus = (0u32..)
        .zip(flag)
        .map(|(index, &memory)| Gpu { index, uuid: None, product: UNKNOWN_PRODUCT.into(), memory, capacity: memory.saturating_sub(reserve) })
        .collect();
    Inventory { source: Source::Flag, gpus }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::{DeviceMemory, DriverStatus};

    const GIB: u64 = 1 << 30;

    fn view(state: State, devices: Vec<DeviceMemory>) -> DriverView {
        DriverView { status: DriverStatus { state, devices, ..DriverStatus::default() }, ..DriverView::default() }
    }

    fn device(index: u32, memory: Option<u64>) -> DeviceMemory {
        DeviceMemory {
            index,
            minor: index,
            uuid: format!("GPU-{index}"),
            name: "NVIDIA H100 80GB HBM3".into(),
            memory: memory.map(|m| (m, GIB / 2)),
            ..DeviceMemory::default()
        }
    }

    #[test]
    fn a_good_read_gives_every_gpu_with_memory_less_the_reserve() {
        let got = from_view(&view(State::Ok, vec![device(1, Some(80 * GIB)), device(0, Some(80 * GIB)), device(2, None)]), &[], GIB).expect("inventory");
        assert_eq!(got.source, Source::Nvml);
        assert_eq!(got.gpus.iter().map(|g| g.index).collect::<Vec<_>>(), [0, 1], "sorted; the GPU without memory left out");
        assert_eq!(got.gpus[0].capacity, 79 * GIB);
        assert_eq!(got.gpus[0].uuid.as_deref(), Some("GPU-0"));
        assert_eq!(got.gpus[0].product, "NVIDIA H100 80GB HBM3");
        // NVML's answer wins over the flag.
        assert_eq!(from_view(&view(State::Ok, vec![device(0, Some(80 * GIB))]), &[8 * GIB], 0).map(|i| i.source), Some(Source::Nvml));
    }

    #[test]
    fn without_nvml_the_flag_and_while_nvml_fails_nothing_new() {
        let got = from_view(&view(State::Absent, vec![]), &[8 * GIB, 16 * GIB], GIB).expect("the flag's");
        assert_eq!(got.source, Source::Flag);
        assert_eq!(got.gpus.iter().map(|g| (g.index, g.capacity, g.uuid.is_none())).collect::<Vec<_>>(), [(0, 7 * GIB, true), (1, 15 * GIB, true)]);
        assert_eq!(got.gpus[0].product, UNKNOWN_PRODUCT);
        for state in [State::Starting, State::Failing, State::Hung] {
            assert_eq!(from_view(&view(state, vec![device(0, Some(GIB))]), &[GIB], 0), None, "{state:?}");
        }
        assert_eq!(from_view(&view(State::Absent, vec![]), &[], 0), None);
        assert_eq!(from_flag(&[GIB], 2 * GIB).gpus[0].capacity, 0, "a reserve past the memory leaves nothing");
    }
}
