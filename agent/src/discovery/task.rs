//! The discovery task: owns the loaded eBPF programs (the uprobes go on what it finds) and the
//! [`Discovery`] state, scans the processes' maps every `--rescan-ms` on the blocking pool
//! (files and `/proc` entries are the tenants' to make expensive: nothing else waits on a
//! scan), and publishes what is probed. When it stops, it hands the programs back so that the
//! agent detaches them last.
use std::{sync::Arc, time::Duration};

use aya::Ebpf;
use tokio::{
    sync::watch,
    time::{interval, MissedTickBehavior},
};
use tracing::warn;

use super::{Discovery, DiscoveryStats};
use crate::{
    kernel::probes::{AttachReport, Attacher},
    task::Heartbeat,
};

/// What discovery has probed and skipped, as of its last scan.
#[derive(Clone, Debug, Default)]
pub struct Found {
    pub probed: Vec<AttachReport>,
    pub stats: DiscoveryStats,
}

impl Found {
    pub fn of(discovery: &Discovery) -> Found {
        Found { probed: discovery.probed().cloned().collect(), stats: discovery.stats() }
    }
}

/// The task's state.
pub struct Scanner {
    pub discovery: Discovery,
    pub ebpf: Ebpf,
}

impl Scanner {
    /// Scans every `every` (never with `scan` false: `--no-discover`) until `stop` turns true;
    /// returns the programs.
    pub async fn run(
        mut self,
        every: Duration,
        scan: bool,
        published: watch::Sender<Arc<Found>>,
        heartbeat: Heartbeat,
        mut stop: watch::Receiver<bool>,
    ) -> Option<Ebpf> {
        let mut timer = interval(every);
        timer.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            heartbeat.beat();
            tokio::select! {
                _ = stop.changed() => return Some(self.ebpf),
                _ = timer.tick(), if scan => {}
            }
            let beat = heartbeat.clone();
            let work = tokio::task::spawn_blocking(move || {
                let mut state = self;
                state.discovery.scan(&mut Attacher(&mut state.ebpf));
                beat.beat();
                state
            });
            self = match work.await {
                Ok(state) => state,
                Err(error) => {
                    // The programs went with the step: nothing is probed from now on, which the
                    // heartbeat (silent from now on) and the log say.
                    warn!(%error, "a discovery scan failed: no more files are probed");
                    return None;
                }
            };
            published.send_replace(Arc::new(Found::of(&self.discovery)));
        }
    }
}
