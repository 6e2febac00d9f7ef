//! The discovery task: owns the [`Discovery`] state, scans the processes' maps every
//! `--rescan-ms` on the blocking pool (those the kernel named since the last scan,
//! [`ExecMapped`], and every process every `--full-rescan-ms`) (files and `/proc` entries are the tenants' to make
//! expensive: nothing else waits on a scan), asks the kernel task, which owns the programs,
//! to probe each libcuda it identifies ([`RemoteAttacher`]), and publishes what is probed. A
//! panic while reading one tenant's file or maps skips that file or process
//! ([`Discovery::scan`]); any other end of a scan step ends the task, and the agent with it.
use std::{collections::BTreeMap, sync::Arc, time::Duration};

use anyhow::{anyhow, Context, Result};
use tokio::{
    sync::watch,
    time::{interval, MissedTickBehavior},
};

use super::{Discovery, DiscoveryStats, Told};
use crate::{
    kernel::exec::ExecMapped,
    libcuda::{AttachReport, AttachRequest, Opened, Prober},
    task::Heartbeat,
};

/// How long discovery waits for the kernel task to attach to one file (it answers at its
/// next turn: within a drain, unless it is stuck, which its heartbeat says).
const ATTACH_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Discovery's [`Prober`] while the agent runs: each attach is asked of the kernel task, and
/// waited for on discovery's own (blocking) thread.
pub struct RemoteAttacher(pub tokio::sync::mpsc::Sender<AttachRequest>);

impl Prober for RemoteAttacher {
    fn attach(&mut self, file: &Opened, offsets: &BTreeMap<&'static str, u64>) -> Result<AttachReport> {
        let own = file.file.try_clone().context("cannot duplicate the file's descriptor")?;
        let file = Opened { file: own, id: file.id, stamp: file.stamp, shown: file.shown.clone() };
        let (reply, answer) = std::sync::mpsc::sync_channel(1);
        self.0
            .blocking_send(AttachRequest { file, offsets: offsets.clone(), reply })
            .map_err(|_| anyhow!("the kernel task, which attaches probes, is gone"))?;
        answer
            .recv_timeout(ATTACH_WAIT)
            .map_err(|_| anyhow!("the kernel task did not attach within {ATTACH_WAIT:?}"))?
    }
}

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
    /// The kernel's word on new executable mappings (none: scans go by the timer alone).
    pub told: Option<ExecMapped>,
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
                let told = state.told.as_mut().map(|told| {
                    let (pids, lost) = told.take();
                    Told { pids: pids.into_iter().filter(|pid| !crate::fault::deaf_to(*pid)).collect(), lost }
                });
                state.discovery.scan(told, &mut state.attacher);
                beat.beat();
                state
            });
            // The probes are the kernel task's: a failed step loses only discovery's state.
            self = work.await.map_err(|error| anyhow!("a discovery scan failed: {error}"))?;
            published.send_replace(Arc::new(Found::of(&self.discovery)));
        }
    }
}
