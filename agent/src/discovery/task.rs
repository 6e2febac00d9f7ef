//! The discovery task: owns the [`Discovery`] state, scans the processes' maps every
//! `--rescan-ms` on the blocking pool (files and `/proc` entries are the tenants' to make
//! expensive: nothing else waits on a scan), asks the kernel task, which owns the programs,
//! to probe each libcuda it identifies ([`RemoteAttacher`]), and publishes what is probed. A
//! panic while reading one tenant's file or maps skips that file or process
//! ([`Discovery::scan`]); any other end of a scan step ends the task, and the agent with it.
use std::{sync::Arc, time::Duration};

use anyhow::{anyhow, Result};
use tokio::{
    sync::watch,
    time::{interval, MissedTickBehavior},
};

use super::{Discovery, DiscoveryStats};
use crate::{
    kernel::probes::{AttachReport, RemoteAttacher},
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
    pub attacher: RemoteAttacher,
}

impl Scanner {
    /// Scans every `every` (never with `scan` false: `--no-discover`) until `stop` turns true.
    pub async fn run(
        mut self,
        every: Duration,
        scan: bool,
        published: watch::Sender<Arc<Found>>,
        heartbeat: Heartbeat,
        mut stop: watch::Receiver<bool>,
    ) -> Result<()> {
        let mut timer = interval(every);
        timer.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            heartbeat.beat();
            tokio::select! {
                _ = stop.changed() => return Ok(()),
                _ = timer.tick(), if scan => {}
            }
            let beat = heartbeat.clone();
            let work = tokio::task::spawn_blocking(move || {
                let mut state = self;
                state.discovery.scan(&mut state.attacher);
                beat.beat();
                state
            });
            // The probes are the kernel task's: a failed step loses only discovery's state.
            self = work.await.map_err(|error| anyhow!("a discovery scan failed: {error}"))?;
            published.send_replace(Arc::new(Found::of(&self.discovery)));
        }
    }
}
