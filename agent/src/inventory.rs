//! The node's GPUs, one inventory for the whole agent: each GPU's index (its minor number: the
//! DRA device name `gpu-<N>` and `/dev/nvidia<N>`), UUID, product, memory, and the `memory`
//! capacity claims may share (the memory less the driver's reserve, `--dra-memory-reserve`).
//! What the DRA driver's ResourceSlices publish, what prepare checks claims against, what its
//! health lists and what the NRI side maps device nodes and sizes with are this one value
//! ([`Tracker`] sends it on a watch channel), so that no part of the agent sizes the node
//! otherwise than another.
//!
//! Where from: the driver view's last good NVML read ([`crate::driver`]): every GPU it lists
//! with a memory figure. A GPU NVML stops listing (removed from the bus) leaves the
//! inventory at the next read; a read that fails or hangs changes nothing (a GPU is not gone
//! because NVML did not answer: health is the DRA plugin's to report). NVML's figures win
//! over `--gpu-memory`, which is then ignored (a warning names both where they differ: an
//! H100 "80GB" has 81559 MiB, not the 80Gi of a flag). Where the node has no NVML (`absent`),
//! `--gpu-memory` is a fake inventory, one GPU per value: no UUID, product `unknown`, and the
//! attribute `source: gpu-memory` says so on every device. It must then give one size per GPU
//! the host's device files show (`/dev/nvidia<N>` under `--host-root`, or in the GPU operator's
//! driver root): another count is an error that stops the agent, saying both (one `80Gi` on a
//! node of eight GPUs would make a node of one).
use std::sync::Arc;

use tokio::sync::watch;
use tracing::{info, warn};

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

impl Inventory {
    /// GPU `index` (its minor number), if the node has it.
    pub fn gpu(&self, index: u32) -> Option<&Gpu> {
        self.gpus.iter().find(|gpu| gpu.index == index)
    }

    /// One past the highest index: the range of indices a device node may name.
    pub fn index_bound(&self) -> u32 {
        self.gpus.iter().map(|gpu| gpu.index.saturating_add(1)).max().unwrap_or(0)
    }

    /// Where `--gpu-memory` disagrees with NVML's figures, what it says and what NVML says
    /// (one value is every GPU's size; a list is one per GPU, by position); `None` where it
    /// agrees, is not given, or this inventory is the flag's.
    pub fn flag_disagreement(&self, flag: &[u64]) -> Option<String> {
        if self.source != Source::Nvml || flag.is_empty() {
            return None;
        }
        let nvml: Vec<u64> = self.gpus.iter().map(|gpu| gpu.memory).collect();
        let agrees = match flag {
            [one] => nvml.iter().all(|memory| memory == one),
            list => list == nvml.as_slice(),
        };
        (!agrees).then(|| format!("--gpu-memory says {flag:?} bytes, NVML says {nvml:?} (GPUs {:?})", self.gpus.iter().map(|g| g.index).collect::<Vec<_>>()))
    }
}

/// The inventory as the agent's parts read it: `None` until the first good read (or the flag's).
pub type Shared = watch::Receiver<Option<Arc<Inventory>>>;

/// GPU `index`'s memory as `shared` has it; `None` before the first inventory (NVML not read
/// yet, or failing before it ever answered: `--gpu-memory` is not the node's word then, NVML
/// is; where NVML is absent the inventory is the flag's already).
pub fn memory_of(shared: &Shared, index: usize) -> Option<u64> {
    let inventory = shared.borrow();
    u32::try_from(index).ok().and_then(|index| inventory.as_ref()?.gpu(index)).map(|gpu| gpu.memory)
}

/// A receiver that never changes, holding `inventory` (tests, and the parts built before the
/// tracker).
pub fn fixed(inventory: Option<Inventory>) -> Shared {
    watch::channel(inventory.map(Arc::new)).1
}

/// The task that keeps [`Shared`] current from the driver view: it sends a new inventory
/// whenever the view gives one that differs, and keeps the last one while NVML fails, hangs
/// or has not answered yet.
pub struct Tracker {
    /// `--gpu-memory`.
    pub flag: Vec<u64>,
    /// What no claim can have of a GPU (`--dra-memory-reserve`; 0 without `--dra`).
    pub reserve: u64,
    /// The host's GPU device files (patterns, `{minor}` standing for the number), which the
    /// flag must match where NVML is absent ([`device_files`], looked at once, at the start).
    pub device_files: Vec<String>,
}

/// The minor numbers whose GPU device file exists under any of `patterns` (the host's
/// `/dev/nvidia{minor}`, the GPU operator's driver root's), looked at up to [`MAX_MINOR`].
pub fn device_files(patterns: &[String]) -> Vec<u32> {
    (0..MAX_MINOR)
        .filter(|minor| patterns.iter().any(|pattern| std::path::Path::new(&pattern.replace("{minor}", &minor.to_string())).exists()))
        .collect()
}

/// The GPU minor numbers looked at for device files (the driver numbers GPUs below 255;
/// nodes have at most 16).
pub const MAX_MINOR: u32 = 64;

/// Where `--gpu-memory` is the inventory (NVML absent), why it cannot be: its count is not
/// the count of the node's GPU device files.
pub fn flag_mismatch(flag: &[u64], device_files: &[u32], patterns: &[String]) -> Option<String> {
    (!flag.is_empty() && !device_files.is_empty() && flag.len() != device_files.len()).then(|| {
        format!(
            "NVML is absent and --gpu-memory gives {} size(s), but the node has {} GPU device files ({} for minors {device_files:?}): \
             give one size per GPU (e.g. --gpu-memory={}), or give the agent the driver's NVML (--host-root, --nvml)",
            flag.len(),
            device_files.len(),
            patterns.join(" or "),
            vec!["80Gi"; device_files.len()].join(",")
        )
    })
}

impl Tracker {
    /// Runs until `stop` (or the driver view's sender is gone at the stop).
    pub async fn run(self, mut driver: watch::Receiver<Arc<DriverView>>, sender: watch::Sender<Option<Arc<Inventory>>>, mut stop: watch::Receiver<bool>) -> anyhow::Result<()> {
        let mut warned = false;
        let files = device_files(&self.device_files);
        loop {
            let seen = from_view(&driver.borrow_and_update(), &self.flag, self.reserve);
            if seen.as_ref().is_some_and(|seen| seen.source == Source::Flag) {
                if let Some(mismatch) = flag_mismatch(&self.flag, &files, &self.device_files) {
                    anyhow::bail!("{mismatch}");
                }
            }
            if let Some(seen) = seen.filter(|seen| sender.borrow().as_deref() != Some(seen)) {
                info!(source = seen.source.name(), gpus = ?seen.gpus.iter().map(|g| (g.index, g.memory)).collect::<Vec<_>>(), "the node's GPUs");
                if seen.source == Source::Flag {
                    warn!(
                        gpus = seen.gpus.len(),
                        "NVML is absent (no driver library found, or the agent's container was not given the driver): the node's GPUs are \
                         --gpu-memory's, one per value, whatever the node has"
                    );
                }
                match seen.flag_disagreement(&self.flag) {
                    Some(disagreement) if !warned => {
                        warn!("{disagreement}: NVML's figures are the node's; --gpu-memory is ignored where NVML answers");
                        warned = true;
                    }
                    _ => {}
                }
                sender.send_replace(Some(Arc::new(seen)));
            }
            tokio::select! {
                _ = stop.changed() => return Ok(()),
                changed = driver.changed() => if changed.is_err() {
                    if *stop.borrow() {
                        return Ok(());
                    }
                    anyhow::bail!("the driver view is no longer published");
                },
            }
        }
    }
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

    #[test]
    fn gpus_are_found_by_minor_and_the_flag_checked_against_nvml() {
        let got = from_view(&view(State::Ok, vec![device(3, Some(80 * GIB)), device(0, Some(80 * GIB))]), &[], 0).expect("inventory");
        assert_eq!(got.gpu(3).map(|g| g.memory), Some(80 * GIB));
        assert!(got.gpu(1).is_none(), "minor 1 is not listed");
        assert_eq!(got.index_bound(), 4);
        assert_eq!(got.flag_disagreement(&[]), None);
        assert_eq!(got.flag_disagreement(&[80 * GIB]), None, "one size, every GPU's");
        assert_eq!(got.flag_disagreement(&[80 * GIB, 80 * GIB]), None, "one per GPU");
        let said = got.flag_disagreement(&[8 * GIB]).expect("another size");
        assert!(said.contains(&format!("{:?}", [8 * GIB])) && said.contains(&format!("{:?}", [80 * GIB, 80 * GIB])), "{said}");
        assert!(got.flag_disagreement(&[80 * GIB]).is_none() && got.flag_disagreement(&[80 * GIB; 3]).is_some(), "a list of another length");
        assert_eq!(from_flag(&[GIB], 0).flag_disagreement(&[2 * GIB]), None, "the flag's own inventory");
        assert_eq!(from_flag(&[], 0).index_bound(), 0);
    }

    #[tokio::test]
    async fn without_nvml_a_flag_of_another_count_than_the_device_files_stops_the_tracker_saying_both() {
        let dir = std::env::temp_dir().join(format!("vramguard-inventory-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        for minor in [0, 1, 3] {
            std::fs::write(dir.join(format!("nvidia{minor}")), b"").expect("a device file stand-in");
        }
        std::fs::write(dir.join("nvidiactl"), b"").expect("not a GPU");
        let pattern = vec![format!("{}/nvidia{{minor}}", dir.display()), "/nonexistent/nvidia{minor}".to_string()];
        assert_eq!(device_files(&pattern), [0, 1, 3]);
        let run = |flag: Vec<u64>, state: State| {
            let (driver_tx, driver_rx) = watch::channel(Arc::new(view(state, vec![device(0, Some(80 * GIB))])));
            let (sender, shared) = watch::channel(None);
            let (stop_tx, stop) = watch::channel(false);
            let tracker = Tracker { flag, reserve: 0, device_files: pattern.clone() };
            async move {
                // Kept while the tracker runs: it ends when its senders are gone.
                let _senders = (driver_tx, stop_tx);
                let ended = tokio::time::timeout(std::time::Duration::from_millis(200), tracker.run(driver_rx, sender, stop)).await;
                (ended, shared.borrow().clone())
            }
        };
        let (ended, shared) = run(vec![80 * GIB], State::Absent).await;
        let error = ended.expect("ended at once").expect_err("one size for three GPUs");
        let said = format!("{error:#}");
        assert!(said.contains("gives 1 size(s), but the node has 3 GPU device files") && said.contains("--gpu-memory=80Gi,80Gi,80Gi"), "{said}");
        assert_eq!(shared, None, "nothing published from a flag that does not match");
        let (ended, shared) = run(vec![80 * GIB; 3], State::Absent).await;
        assert!(ended.is_err(), "one per GPU: the tracker runs on");
        assert_eq!(shared.map(|i| i.gpus.len()), Some(3));
        // NVML answers: the flag is not the inventory, whatever its count.
        let (ended, shared) = run(vec![80 * GIB], State::Ok).await;
        assert!(ended.is_err(), "runs on");
        assert_eq!(shared.map(|i| i.source), Some(Source::Nvml));
        assert_eq!(flag_mismatch(&[GIB], &[], &pattern), None, "no device file seen: the flag as given");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn the_tracker_keeps_the_last_good_inventory_and_sends_changes_only() {
        let (driver_tx, driver_rx) = watch::channel(Arc::new(view(State::Starting, vec![])));
        let (sender, mut shared) = watch::channel(None);
        let (stop_tx, stop) = watch::channel(false);
        let task = tokio::spawn(Tracker { flag: vec![8 * GIB], reserve: GIB, device_files: vec!["/nonexistent/nvidia{minor}".into()] }.run(driver_rx, sender, stop));
        driver_tx.send_replace(Arc::new(view(State::Ok, vec![device(0, Some(80 * GIB)), device(1, Some(80 * GIB))])));
        shared.changed().await.expect("sent");
        let first = shared.borrow_and_update().clone().expect("two GPUs");
        assert_eq!((first.source, first.gpus.len(), first.gpus[1].capacity), (Source::Nvml, 2, 79 * GIB), "NVML's, not the flag's");
        // NVML failing: the inventory stays; the same read again: nothing sent.
        driver_tx.send_replace(Arc::new(view(State::Failing, vec![])));
        driver_tx.send_replace(Arc::new(view(State::Ok, vec![device(0, Some(80 * GIB)), device(1, Some(80 * GIB))])));
        tokio::task::yield_now().await;
        // GPU 1 gone from the bus: sent.
        driver_tx.send_replace(Arc::new(view(State::Ok, vec![device(0, Some(80 * GIB))])));
        shared.changed().await.expect("sent");
        assert_eq!(shared.borrow_and_update().as_ref().map(|i| i.gpus.len()), Some(1));
        stop_tx.send_replace(true);
        task.await.expect("joined").expect("a clean end");
    }
}
