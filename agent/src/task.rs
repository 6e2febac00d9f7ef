//! What the agent's tasks share, below all of them: their sign of life (each task
//! [`Heartbeat::beat`]s whenever it comes round its loop, and the health listener
//! ([`crate::serve::health`]) reads when each last did: a word per task, so that a task stuck
//! on tenant work shows up as that task and health never waits on it), and waiting on an
//! input a task may not have ([`changed`]).
use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

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
