//! The driver task: asks its reader thread (which owns NVML: loading, init, reads) for a read
//! every [`EVERY`] and publishes each answer as the latest [`DriverView`]. A read that has
//! not come back within [`READ_BUDGET`] makes the view `hung`; no other read starts until it
//! returns (a hung NVML call holds one thread, never the runtime or another task). Without
//! NVML, the reader retries loading it every [`RETRY`]. Each read's time (the NVML calls
//! alone, on the reader thread) goes into `vramguard_driver_read_seconds` ([`read_seconds`]).
use std::{
    path::PathBuf,
    sync::{mpsc as std_mpsc, Arc},
    time::{Duration, Instant},
};

use prometheus::{Histogram, HistogramOpts};
use tokio::{
    sync::{oneshot, watch},
    time::{interval, MissedTickBehavior},
};
use tracing::{info, warn};

use super::{
    nvml::{Nvml, Trouble},
    DriverStatus, DriverView, State,
};
use crate::task::Heartbeat;

/// How often NVML is read.
pub const EVERY: Duration = Duration::from_secs(1);
/// How long a read may take before the view is `hung`.
pub const READ_BUDGET: Duration = Duration::from_secs(2);
/// How often the reader tries again to load and initialize NVML while it has none.
pub const RETRY: Duration = Duration::from_secs(30);

/// One read's answer: the library loaded (if any) and what it said.
type Answer = (Option<String>, Result<std::collections::BTreeMap<u32, super::DriverProcess>, Trouble>);

/// Buckets of [`read_seconds`]: NVML reads take from tens of microseconds (the fake, a few
/// processes) to milliseconds (a real driver, many devices), up to the budget.
const READ_BUCKETS: [f64; 11] = [0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25, 2.0];

/// The histogram of NVML read times the driver task fills (the caller registers it with the
/// metrics registry).
pub fn read_seconds() -> prometheus::Result<Histogram> {
    Histogram::with_opts(
        HistogramOpts::new(
            "vramguard_driver_read_seconds",
            "One NVML read (every device's running processes and their memory), timed on the reader thread; a read that fails counts too",
        )
        .buckets(READ_BUCKETS.to_vec()),
    )
}

/// The driver task's state.
pub struct Driver {
    /// The NVML files to try, in order ([`super::locate`]).
    pub candidates: Vec<PathBuf>,
    /// Where each read's time goes ([`read_seconds`]).
    pub read_seconds: Histogram,
}

impl Driver {
    /// Runs until `stop` turns true, publishing into `view`.
    pub async fn run(self, view: watch::Sender<Arc<DriverView>>, heartbeat: Heartbeat, mut stop: watch::Receiver<bool>) {
        let (requests, reader_requests) = std_mpsc::channel::<oneshot::Sender<Answer>>();
        let (candidates, read_seconds) = (self.candidates, self.read_seconds);
        let spawned =
            std::thread::Builder::new().name("vramguard-nvml".into()).spawn(move || reader(candidates, read_seconds, reader_requests));
        if let Err(error) = spawned {
            publish(&view, DriverStatus { state: State::Failing, reason: Some(format!("cannot start the NVML reader thread: {error}")), library: None, reads: 0 }, None);
            return;
        }
        let mut tick = interval(EVERY);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut pending: Option<(oneshot::Receiver<Answer>, Instant)> = None;
        let mut reads = 0u64;
        loop {
            heartbeat.beat();
            tokio::select! {
                _ = stop.changed() => break,
                _ = tick.tick() => match &pending {
                    None => {
                        let (ask, answer) = oneshot::channel();
                        if requests.send(ask).is_err() {
                            publish(&view, DriverStatus { state: State::Failing, reason: Some("the NVML reader thread ended".into()), library: None, reads }, None);
                            return;
                        }
                        pending = Some((answer, Instant::now()));
                    }
                    Some((_, started)) if started.elapsed() > READ_BUDGET && view.borrow().status.state != State::Hung => {
                        let library = view.borrow().status.library.clone();
                        let reason = format!("an NVML read has not returned for {} ms (budget {} ms): no other read starts until it does", started.elapsed().as_millis(), READ_BUDGET.as_millis());
                        publish(&view, DriverStatus { state: State::Hung, reason: Some(reason), library, reads }, None);
                    }
                    Some(_) => {}
                },
                answer = async { pending.as_mut().map(|(rx, _)| rx).expect("guarded by the condition").await }, if pending.is_some() => {
                    let started = pending.take().map(|(_, at)| at);
                    let Ok((library, answer)) = answer else {
                        publish(&view, DriverStatus { state: State::Failing, reason: Some("the NVML reader thread ended".into()), library: None, reads }, None);
                        return;
                    };
                    match answer {
                        Ok(processes) => {
                            reads += 1;
                            let status = DriverStatus { state: State::Ok, reason: None, library, reads };
                            publish(&view, status, Some((processes, started.unwrap_or_else(Instant::now))));
                        }
                        Err(trouble) => publish(&view, DriverStatus { state: trouble.state, reason: Some(trouble.reason), library, reads }, None),
                    }
                }
            }
        }
    }
}

/// Publishes a new view, logging once per change of state (or of reason while not `ok`).
fn publish(view: &watch::Sender<Arc<DriverView>>, status: DriverStatus, read: Option<(std::collections::BTreeMap<u32, super::DriverProcess>, Instant)>) {
    let before = view.borrow().status.clone();
    if before.state != status.state || (status.state != State::Ok && before.reason != status.reason && status.state != State::Hung) {
        let reason = status.reason.as_deref().unwrap_or("");
        let library = status.library.as_deref().unwrap_or("");
        if status.state == State::Ok {
            info!(library, "driver view: NVML answers; processes are joined with its per-process memory");
        } else {
            warn!(state = status.state.name(), reason, library, "driver view unavailable: the agent runs on the probes and the ledgers alone");
        }
    }
    let (processes, read_at) = match read {
        Some((processes, at)) => (processes, Some(at)),
        None => (Default::default(), None),
    };
    view.send_replace(Arc::new(DriverView { status, processes, read_at }));
}

/// The reader thread: owns NVML, answers each request with one read (loading NVML first when
/// it has none, at most every [`RETRY`]); ends when the task drops its end.
fn reader(candidates: Vec<PathBuf>, read_seconds: Histogram, requests: std_mpsc::Receiver<oneshot::Sender<Answer>>) {
    let mut nvml: Option<Nvml> = None;
    let mut last_trouble: Option<(Trouble, Instant)> = None;
    while let Ok(reply) = requests.recv() {
        if nvml.is_none() {
            match &last_trouble {
                Some((trouble, at)) if at.elapsed() < RETRY => {
                    let _ = reply.send((None, Err(trouble.clone())));
                    continue;
                }
                _ => match Nvml::open(&candidates) {
                    Ok(opened) => nvml = Some(opened),
                    Err(trouble) => {
                        last_trouble = Some((trouble.clone(), Instant::now()));
                        let _ = reply.send((None, Err(trouble)));
                        continue;
                    }
                },
            }
        }
        let Some(loaded) = nvml.as_ref() else { continue };
        let started = Instant::now();
        let answer = loaded.read();
        read_seconds.observe(started.elapsed().as_secs_f64());
        let _ = reply.send((Some(loaded.path().display().to_string()), answer));
    }
}
