//! The listener's connection cap. At most `cap` connections are open at once (a semaphore's
//! permits). When every permit is taken, the oldest connection that has not delivered its
//! request yet is evicted to make room for the newcomer, so idle or slow clients cannot keep
//! a scraper out; when every open connection is being answered, the newcomer is refused (the
//! listener closes it at once).
use std::{
    collections::BTreeMap,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex, MutexGuard, PoisonError,
    },
    time::Duration,
};

use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};

/// How long an admission waits for an evicted connection to give its permit back.
const EVICTION_WAIT: Duration = Duration::from_secs(1);

pub struct Gate {
    cap: usize,
    permits: Arc<Semaphore>,
    waiting: Mutex<Waiting>,
}

/// The connections still waiting for their request, oldest first.
#[derive(Default)]
struct Waiting {
    next: u64,
    /// Admission number → the signal that evicts the connection.
    by_age: BTreeMap<u64, oneshot::Sender<()>>,
}

/// How an admission went.
pub enum Admission {
    /// The connection may proceed: its ticket, and the signal that it has been evicted.
    Admitted { ticket: Arc<Ticket>, evicted: oneshot::Receiver<()>, made_room: bool },
    /// Every connection is being answered: close the newcomer.
    Refused,
}

/// One admitted connection: holds its permit until dropped.
pub struct Ticket {
    gate: Arc<Gate>,
    id: u64,
    arrived: AtomicBool,
    _permit: OwnedSemaphorePermit,
}

impl Gate {
    pub fn new(cap: usize) -> Arc<Gate> {
        Arc::new(Gate { cap, permits: Arc::new(Semaphore::new(cap)), waiting: Mutex::new(Waiting::default()) })
    }

    /// Admits a new connection, evicting the oldest one still waiting for its request if the
    /// cap is reached.
    pub async fn admit(self: &Arc<Self>) -> Admission {
        let (permit, made_room) = match self.permits.clone().try_acquire_owned() {
            Ok(permit) => (permit, false),
            Err(_) => {
                let Some(evict) = self.pop_oldest() else { return Admission::Refused };
                // The evicted connection's task ends on this signal and its ticket, dropped,
                // gives the permit back.
                let _ = evict.send(());
                match tokio::time::timeout(EVICTION_WAIT, self.permits.clone().acquire_owned()).await {
                    Ok(Ok(permit)) => (permit, true),
                    _ => return Admission::Refused,
                }
            }
        };
        let (signal, evicted) = oneshot::channel();
        let id = {
            let mut waiting = self.waiting();
            let id = waiting.next;
            waiting.next += 1;
            waiting.by_age.insert(id, signal);
            id
        };
        let ticket = Arc::new(Ticket { gate: self.clone(), id, arrived: AtomicBool::new(false), _permit: permit });
        Admission::Admitted { ticket, evicted, made_room }
    }

    /// How many connections are open.
    pub fn open(&self) -> usize {
        self.cap - self.permits.available_permits()
    }

    fn pop_oldest(&self) -> Option<oneshot::Sender<()>> {
        self.waiting().by_age.pop_first().map(|(_, signal)| signal)
    }

    fn waiting(&self) -> MutexGuard<'_, Waiting> {
        // The map stays consistent whatever a panicking holder was doing: each step is one
        // insert or remove.
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Ticket {
    /// The connection's request has arrived: from now on it is answered, never evicted. One
    /// that an admission took from the waiting list a moment before stays evicted (its signal
    /// is on its way): it is not marked arrived.
    pub fn arrived(&self) {
        if self.gate.waiting().by_age.remove(&self.id).is_some() {
            self.arrived.store(true, Ordering::Relaxed);
        }
    }

    /// Whether a request arrived on this connection.
    pub fn has_arrived(&self) -> bool {
        self.arrived.load(Ordering::Relaxed)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.gate.waiting().by_age.remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admitted(admission: Admission) -> (Arc<Ticket>, oneshot::Receiver<()>, bool) {
        match admission {
            Admission::Admitted { ticket, evicted, made_room } => (ticket, evicted, made_room),
            Admission::Refused => panic!("refused"),
        }
    }

    /// A connection's task: holds its ticket until evicted (or told to stop).
    fn hold(ticket: Arc<Ticket>, evicted: oneshot::Receiver<()>) -> tokio::task::JoinHandle<bool> {
        tokio::spawn(async move {
            let was_evicted = evicted.await.is_ok();
            drop(ticket);
            was_evicted
        })
    }

    #[tokio::test]
    async fn the_oldest_waiting_connection_makes_room() {
        let gate = Gate::new(2);
        let (first, first_evicted, made_room) = admitted(gate.admit().await);
        assert!(!made_room);
        let (second, second_evicted, _) = admitted(gate.admit().await);
        let first = hold(first, first_evicted);
        let second = hold(second, second_evicted);
        assert_eq!(gate.open(), 2);
        let (_third, _third_evicted, made_room) = admitted(gate.admit().await);
        assert!(made_room, "the cap was reached: someone had to go");
        assert!(first.await.expect("task"), "the oldest connection was evicted");
        assert!(!second.is_finished(), "the younger one stays");
        assert_eq!(gate.open(), 2);
        second.abort();
    }

    #[tokio::test]
    async fn connections_being_answered_are_never_evicted() {
        let gate = Gate::new(2);
        let (a, _a_evicted, _) = admitted(gate.admit().await);
        let (b, b_evicted, _) = admitted(gate.admit().await);
        a.arrived();
        // Only b is still waiting: it goes, a stays.
        let b = hold(b, b_evicted);
        let (c, _c_evicted, made_room) = admitted(gate.admit().await);
        assert!(made_room);
        assert!(b.await.expect("task"));
        c.arrived();
        assert!(matches!(gate.admit().await, Admission::Refused), "both connections are being answered");
        assert!(a.has_arrived() && c.has_arrived());
        // A connection that ends gives its place back.
        drop(a);
        let (_d, _, made_room) = admitted(gate.admit().await);
        assert!(!made_room);
    }

    #[tokio::test]
    async fn a_connection_that_ended_leaves_the_waiting_list() {
        let gate = Gate::new(1);
        let (a, _a_evicted, _) = admitted(gate.admit().await);
        drop(a);
        assert!(gate.waiting().by_age.is_empty());
        let (_b, _, made_room) = admitted(gate.admit().await);
        assert!(!made_room, "the permit came back with the ticket");
    }
}
