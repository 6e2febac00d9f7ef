//! A test's NRI plugin on a thread of its own, with a current-thread runtime as in the agent:
//! its handler reports what the runtime hands over on a channel ([`Plugin::seen`]). Shared by
//! the tests that run an NRI handler of their own against a real containerd (`nri_plugin.rs`,
//! `dra_containerd.rs`); a test module, not the e2e library, which does not depend on the agent.
#![allow(dead_code)]
use std::{
    path::Path,
    sync::{mpsc, Arc},
    thread::JoinHandle,
    time::Duration,
};

use agent::provision::nri::{self, Handler};
use e2e::{timeout, wait_for};

/// The plugin; stopped (its thread joined) when dropped.
pub struct Plugin<T> {
    /// What the handler reported.
    pub seen: mpsc::Receiver<T>,
    /// Whether the plugin is registered with the runtime now.
    pub connected: tokio::sync::watch::Receiver<bool>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl<T> Plugin<T> {
    /// `handler`, as plugin `name` (index 10, a 1.5 s handler deadline) on the runtime's NRI
    /// `socket`; `seen` receives what it reports.
    pub fn start<H: Handler + Send + Sync + 'static>(socket: &Path, name: &str, handler: H, seen: mpsc::Receiver<T>) -> Plugin<T> {
        let (connected_tx, connected) = tokio::sync::watch::channel(false);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let config = nri::Config { socket: socket.to_path_buf(), name: name.into(), index: "10".into(), handler_deadline: Duration::from_millis(1500) };
        let handler = Arc::new(handler);
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a tokio runtime");
            runtime.block_on(async move {
                tokio::select! {
                    () = nri::run(config, handler, connected_tx) => {}
                    _ = stopped => {}
                }
            });
        });
        Plugin { seen, connected, stop: Some(stop), thread: Some(thread) }
    }

    /// The handler's next report (panics past the tests' timeout).
    pub fn next(&self) -> T {
        self.seen.recv_timeout(timeout()).expect("the handler is called")
    }

    /// Waits until the plugin is registered; how long that took.
    pub fn wait_connected(&self) -> Duration {
        wait_for(timeout(), "the plugin to be connected", || Ok(*self.connected.borrow())).expect("connected")
    }
}

impl<T> Drop for Plugin<T> {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
