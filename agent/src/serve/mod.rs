//! Serving the agent's state: to `vramguard audit` on the control socket ([`control`]), and
//! over HTTP (`--metrics-addr`): [`crate::reconcile::metrics`] renders the Prometheus page (in the reconcile task), [`http`] is the
//! listener and its limits, [`gate`] its connection cap, and this module the [`Board`]
//! between the reconcile task ([`crate::reconcile::task`]) and the listener. After every
//! pass the task says so ([`Progress`], cheap); it renders the metrics page only when a
//! scrape finds the page older than the last pass (at most one render per pass, however many
//! scrapes), and never runs a pass for a scrape. [`health`] is `--health-addr`: `/healthz` and
//! `/readyz` on a listener of their own, from the tasks' heartbeats.
pub mod control;
pub mod gate;
pub mod health;
pub mod http;

use std::{sync::Arc, time::Instant};

use bytes::Bytes;
use tokio::sync::{watch, Notify};

/// What the listener serves, as of a reconcile pass.
#[derive(Clone, Debug)]
pub struct Published {
    /// `/metrics`: the text exposition format, or why it could not be encoded.
    pub metrics: Result<Bytes, String>,
    /// `/readyz`: why the agent is not ready (`None`: ready).
    pub not_ready: Option<&'static str>,
    /// The passes the reconcile task had run when it rendered this.
    pub passes: u64,
}

/// The reconcile task's progress: how many passes it has run, and when the last one ended
/// (`/healthz` fails once that is [`http::STALE_AFTER`] old).
#[derive(Clone, Copy, Debug)]
pub struct Progress {
    pub passes: u64,
    pub at: Instant,
}

/// The listener's side: the latest page, the loop's progress, and the bell that asks the loop
/// for a page of its last pass.
#[derive(Clone)]
pub struct Board {
    pub pages: watch::Receiver<Published>,
    pub progress: watch::Receiver<Progress>,
    pub wanted: Arc<Notify>,
    /// The tasks' heartbeats, added to each `/metrics` page as it is served
    /// ([`health::exposition`]).
    pub liveness: Option<crate::task::Liveness>,
}

/// The reconcile task's side of the [`Board`].
pub struct Publisher {
    pages: watch::Sender<Published>,
    progress: watch::Sender<Progress>,
}

impl Publisher {
    /// A publisher whose first page is `first`; `wanted` is rung when a scrape finds the page
    /// behind the loop's passes.
    pub fn new(first: Published, wanted: Arc<Notify>) -> (Publisher, Board) {
        let progress = Progress { passes: first.passes, at: Instant::now() };
        let (pages, page_view) = watch::channel(first);
        let (progress, progress_view) = watch::channel(progress);
        (Publisher { pages, progress }, Board { pages: page_view, progress: progress_view, wanted, liveness: None })
    }

    /// The loop has run `passes` passes, the last one just now.
    pub fn passed(&self, passes: u64) {
        if self.progress.borrow().passes != passes {
            self.progress.send_replace(Progress { passes, at: Instant::now() });
        }
    }

    /// Whether the page is older than the loop's last pass.
    pub fn behind(&self) -> bool {
        self.pages.borrow().passes < self.progress.borrow().passes
    }

    pub fn publish(&self, page: Published) {
        self.pages.send_replace(page);
    }
}
