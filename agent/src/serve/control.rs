//! The agent's control socket: a Unix socket on which `vramguard run` answers every
//! connection with one JSON [`Snapshot`] and closes it. `vramguard audit` is its client.
use std::{
    fs,
    io::Read,
    os::unix::{fs::PermissionsExt, net::UnixStream},
    path::Path,
};

use anyhow::{Context, Result};

use crate::snapshot::Snapshot;

/// Where the agent listens unless told otherwise.
pub const DEFAULT_SOCKET: &str = "/run/vramguard/agent.sock";

/// Binds the socket, replacing a stale one left by an agent that died; only root may connect.
pub fn bind(path: &Path) -> Result<tokio::net::UnixListener> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir)
            .with_context(|| format!("cannot create the socket directory {}", dir.display()))?;
    }
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            anyhow::bail!(
                "another vramguard agent is already listening on {}: stop it, or give --socket",
                path.display()
            );
        }
        fs::remove_file(path)
            .with_context(|| format!("cannot remove the stale socket {}", path.display()))?;
    }
    let listener = tokio::net::UnixListener::bind(path)
        .with_context(|| format!("cannot listen on {}", path.display()))?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o600))
        .with_context(|| format!("cannot restrict {}", path.display()))?;
    Ok(listener)
}

/// Answers every client with a snapshot asked of the reconcile task (`audits`), each client
/// on a task of its own, until the listener is dropped.
pub async fn listen(listener: tokio::net::UnixListener, audits: tokio::sync::mpsc::Sender<tokio::sync::oneshot::Sender<Snapshot>>) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(error) => {
                tracing::warn!(%error, "control socket accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let audits = audits.clone();
        tokio::spawn(async move {
            let (ask, answer) = tokio::sync::oneshot::channel();
            if audits.send(ask).await.is_err() {
                return;
            }
            match tokio::time::timeout(AUDIT_WAIT, answer).await {
                Ok(Ok(snapshot)) => {
                    if let Err(error) = serve(stream, &snapshot).await {
                        tracing::warn!(%error, "answering a control client failed");
                    }
                }
                _ => tracing::warn!("no snapshot for a control client: the reconcile task did not answer in time"),
            }
        });
    }
}

/// How long a control client waits for its snapshot.
const AUDIT_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Sends one snapshot to a connected client.
pub async fn serve(mut stream: tokio::net::UnixStream, snapshot: &Snapshot) -> Result<()> {
    use tokio::io::AsyncWriteExt;
    let body = serde_json::to_vec(snapshot)?;
    stream.write_all(&body).await?;
    stream.shutdown().await?;
    Ok(())
}

/// Asks the agent listening on `path` for a snapshot.
pub fn fetch(path: &Path) -> Result<Snapshot> {
    let mut stream = UnixStream::connect(path).with_context(|| {
        format!(
            "cannot reach the vramguard agent on {}: is `vramguard run` running (as root)?",
            path.display()
        )
    })?;
    let mut body = String::new();
    stream
        .read_to_string(&mut body)
        .with_context(|| format!("reading from the agent on {}", path.display()))?;
    serde_json::from_str(&body).context("the agent answered with something that is not a snapshot")
}
