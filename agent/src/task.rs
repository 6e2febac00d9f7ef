//! What the agent's tasks share, below all of them: their supervision ([`Tasks`]: every task
//! under its name in one place; the first to end, fail or panic before the agent stops ends
//! the agent, and the stop gives each task a deadline), their sign of life (each task
//! [`Heartbeat::beat`]s whenever it comes round its loop, and the health listener
//! ([`crate::serve::health`]) reads when each last did: a word per task, so that a task stuck
//! on tenant work shows up as that task and health never waits on it), and waiting on an
//! input a task may not have ([`changed`]).
use std::{
    future::Future,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use futures_util::future::select_all;
use tokio::task::JoinHandle;

use crate::fault::{self, Injected};

/// The agent's running tasks, by name.
#[derive(Default)]
pub struct Tasks {
    running: Vec<(&'static str, JoinHandle<anyhow::Result<()>>)>,
    /// Those that hold nothing to put back at the stop (listeners, connections, watches):
    /// aborted at once rather than waited for.
    abortable: Vec<&'static str>,
}

/// How a task ended.
#[derive(Debug)]
pub struct Ended {
    pub task: &'static str,
    /// `None`: it returned `Ok` (which, before the agent stops, is an end all the same).
    pub failure: Option<String>,
}

impl std::fmt::Display for Ended {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.failure {
            Some(failure) => write!(f, "the {} task failed: {failure}", self.task),
            None => write!(f, "the {} task ended", self.task),
        }
    }
}

impl Tasks {
    /// Runs `task` as the task `name` (raced with the faults a test may inject into it).
    pub fn spawn(&mut self, name: &'static str, task: impl Future<Output = anyhow::Result<()>> + Send + 'static) {
        let supervised = async move {
            let mut task = std::pin::pin!(task);
            tokio::select! {
                ended = &mut task => ended,
                injected = fault::armed(name) => match injected {
                    Injected::Panic => panic!("fault injected: the {name} task panics"),
                    // Never polled again: its state stays where it is until the task is aborted.
                    Injected::Park => {
                        tracing::warn!("fault injected: the {name} task is parked");
                        std::future::pending().await
                    }
                },
            }
        };
        self.running.push((name, tokio::spawn(supervised)));
    }

    /// [`Tasks::spawn`] for a task that has no result.
    pub fn spawn_unit(&mut self, name: &'static str, task: impl Future<Output = ()> + Send + 'static) {
        self.spawn(name, async move {
            task.await;
            Ok(())
        });
    }

    /// [`Tasks::spawn_unit`] for a task that does not watch the stop and holds nothing to put
    /// back: it is aborted at the stop.
    pub fn spawn_abortable(&mut self, name: &'static str, task: impl Future<Output = ()> + Send + 'static) {
        self.abortable.push(name);
        self.spawn_unit(name, task);
    }

    /// The tasks' names, in the order they were started.
    pub fn names(&self) -> Vec<&'static str> {
        self.running.iter().map(|(name, _)| *name).collect()
    }

    /// The first task to end, and how; never, without tasks.
    pub async fn first_end(&mut self) -> Ended {
        if self.running.is_empty() {
            return std::future::pending().await;
        }
        let (result, index, _) = select_all(self.running.iter_mut().map(|(_, handle)| handle)).await;
        let (task, _) = self.running.remove(index);
        Ended { task, failure: failure(result) }
    }

    /// Waits up to `grace` for the task `name` (told to stop already) to end, then aborts it;
    /// returns how it ended (a task past its grace: "did not stop within ...").
    pub async fn stop(&mut self, name: &str, grace: Duration) -> Option<Ended> {
        let index = self.running.iter().position(|(n, _)| *n == name)?;
        let (task, handle) = self.running.remove(index);
        Some(stop_one(task, handle, grace).await)
    }

    /// [`Tasks::stop`] for every task left but `kept`, together (the abortable ones at once).
    pub async fn stop_all_but(&mut self, kept: &str, grace: Duration) -> Vec<Ended> {
        let (keep, stop): (Vec<_>, Vec<_>) = std::mem::take(&mut self.running).into_iter().partition(|(name, _)| *name == kept);
        self.running = keep;
        let stopping = stop.into_iter().map(|(task, handle)| {
            if self.abortable.contains(&task) {
                handle.abort();
            }
            stop_one(task, handle, grace)
        });
        let ended = futures_util::future::join_all(stopping).await;
        // An aborted abortable task ended as it was told to.
        ended.into_iter().filter(|e| !(self.abortable.contains(&e.task) && e.failure.as_deref() == Some(ABORTED))).collect()
    }
}

async fn stop_one(task: &'static str, mut handle: JoinHandle<anyhow::Result<()>>, grace: Duration) -> Ended {
    match tokio::time::timeout(grace, &mut handle).await {
        Ok(result) => Ended { task, failure: failure(result) },
        Err(_) => {
            // Aborting drops the task's state (the kernel task's: its programs, so the probes
            // go); a step of it on the blocking pool cannot be aborted and is left to the
            // runtime's shutdown.
            handle.abort();
            let _ = handle.await;
            Ended { task, failure: Some(format!("it did not stop within {grace:?} and was aborted")) }
        }
    }
}

/// How a cancelled task's end reads.
const ABORTED: &str = "task was cancelled";

fn failure(result: Result<anyhow::Result<()>, tokio::task::JoinError>) -> Option<String> {
    match result {
        Err(error) if error.is_cancelled() => Some(ABORTED.into()),
        Ok(Ok(())) => None,
        Ok(Err(error)) => Some(format!("{error:#}")),
        Err(error) if error.is_panic() => Some(format!("it panicked: {}", panic_message(&*error.into_panic()))),
        Err(error) => Some(error.to_string()),
    }
}

/// The end of a task spawned outside [`Tasks`] (one a component runs for itself), for the
/// supervisor to watch: the task holds the [`Sentinel`], and [`Alive::ended`] resolves when
/// it goes (the task returned, panicked or was aborted).
pub fn sentinel() -> (Sentinel, Alive) {
    let (sentinel, alive) = tokio::sync::oneshot::channel();
    (Sentinel(sentinel), Alive(alive))
}

/// Held by a task for as long as it runs.
pub struct Sentinel(#[allow(dead_code, reason = "held for its drop")] tokio::sync::oneshot::Sender<()>);

/// See [`sentinel`].
pub struct Alive(tokio::sync::oneshot::Receiver<()>);

impl Alive {
    /// Resolves when the task has ended.
    pub async fn ended(self) {
        let _ = self.0.await;
    }
}

/// The message of a caught panic.
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// The tasks' heartbeats, by name.
#[derive(Clone)]
pub struct Liveness {
    start: Instant,
    tasks: Arc<Mutex<Vec<Heartbeat>>>,
}

/// One task's heartbeat: milliseconds since the agent's start at its last beat, and how long
/// it may go without one before the agent is not healthy.
#[derive(Clone)]
pub struct Heartbeat {
    pub name: &'static str,
    start: Instant,
    at_ms: Arc<AtomicU64>,
    pub allowed: Duration,
}

impl Heartbeat {
    /// The task is alive and came round its loop now.
    pub fn beat(&self) {
        self.at_ms.store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// How long ago the task last beat.
    pub fn silent_for(&self) -> Duration {
        let at = Duration::from_millis(self.at_ms.load(Ordering::Relaxed));
        self.start.elapsed().saturating_sub(at)
    }
}

impl Default for Liveness {
    fn default() -> Liveness {
        Liveness::new()
    }
}

impl Liveness {
    pub fn new() -> Liveness {
        Liveness { start: Instant::now(), tasks: Arc::new(Mutex::new(Vec::new())) }
    }

    /// A heartbeat for the task `name`, which counts as stuck after `allowed` without a beat.
    pub fn register(&self, name: &'static str, allowed: Duration) -> Heartbeat {
        let heartbeat = Heartbeat { name, start: self.start, at_ms: Arc::new(AtomicU64::new(0)), allowed };
        heartbeat.beat();
        if let Ok(mut tasks) = self.tasks.lock() {
            tasks.push(heartbeat.clone());
        }
        heartbeat
    }

    /// Every task's name, how long it has been silent, and how long it may be.
    pub fn beats(&self) -> Vec<(&'static str, Duration, Duration)> {
        let Ok(tasks) = self.tasks.lock() else { return Vec::new() };
        tasks.iter().map(|t| (t.name, t.silent_for(), t.allowed)).collect()
    }

    /// The tasks silent for longer than they are allowed, with how long.
    pub fn stuck(&self) -> Vec<(&'static str, Duration)> {
        let Ok(tasks) = self.tasks.lock() else { return vec![("liveness", Duration::ZERO)] };
        tasks.iter().map(|t| (t.name, t.silent_for(), t.allowed)).filter(|(_, silent, allowed)| silent > allowed).map(|(n, s, _)| (n, s)).collect()
    }
}

/// The next change of an optional input; never, without it (or once its sender is gone).
pub async fn changed<T>(changes: &mut Option<tokio::sync::watch::Receiver<T>>) {
    if let Some(changes) = changes {
        if changes.changed().await.is_ok() {
            return;
        }
    }
    std::future::pending().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_first_task_to_end_is_named_with_its_panic_and_a_stuck_one_is_aborted_at_the_stop() {
        let mut tasks = Tasks::default();
        tasks.spawn_unit("stuck", std::future::pending());
        tasks.spawn("ok", async { Ok(()) });
        let ended = tasks.first_end().await;
        assert_eq!((ended.task, ended.failure), ("ok", None), "an Ok return is an end too");
        tasks.spawn_unit("broken", async { panic!("boom") });
        let ended = tasks.first_end().await;
        assert_eq!(ended.task, "broken");
        assert_eq!(ended.failure.as_deref(), Some("it panicked: boom"));
        assert_eq!(ended.to_string(), "the broken task failed: it panicked: boom");
        let stopped = tasks.stop_all_but("none", Duration::from_millis(50)).await;
        assert_eq!(stopped.len(), 1);
        assert_eq!(stopped[0].task, "stuck");
        assert!(stopped[0].failure.as_deref().is_some_and(|f| f.contains("did not stop within")), "{stopped:?}");
        assert!(tasks.names().is_empty());
    }

    #[tokio::test]
    async fn a_sentinel_tells_the_supervisor_when_a_task_spawned_elsewhere_ends() {
        let (sentinel, alive) = sentinel();
        let elsewhere = tokio::spawn(async move {
            let _sentinel = sentinel;
            std::future::pending::<()>().await;
        });
        let mut tasks = Tasks::default();
        tasks.spawn_unit("pod-cache", alive.ended());
        tasks.spawn_unit("quiet", std::future::pending());
        elsewhere.abort();
        let ended = tokio::time::timeout(Duration::from_secs(5), tasks.first_end()).await.expect("the end is noticed");
        assert_eq!(ended.task, "pod-cache");
    }

    #[test]
    fn a_task_silent_past_its_allowance_is_stuck() {
        let liveness = Liveness::new();
        let quick = liveness.register("quick", Duration::from_millis(30));
        let _slow = liveness.register("slow", Duration::from_secs(60));
        assert!(liveness.stuck().is_empty());
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(liveness.stuck().iter().map(|(name, _)| *name).collect::<Vec<_>>(), ["quick"]);
        quick.beat();
        assert!(liveness.stuck().is_empty());
    }
}
