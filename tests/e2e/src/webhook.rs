//! `vramguard webhook` as a process of the tests: on loopback ports, reaching the tests' API
//! server with a service account's files, its log in a file; killed when dropped.
use std::{
    ffi::OsString,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
};

use anyhow::{bail, Context, Result};

pub struct Webhook {
    child: Child,
    log: PathBuf,
    /// Where it serves admission reviews, once [`Webhook::serving`] saw it.
    pub addr: SocketAddr,
    /// Where it serves `/metrics`.
    pub metrics: SocketAddr,
}

impl Drop for Webhook {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Webhook {
    /// Starts `vramguard webhook --listen 127.0.0.1:0 --metrics-addr 127.0.0.1:0 ARGS`, reaching
    /// the API server on `api_port` with the token and CA in `account`, its log `log`; not
    /// yet serving ([`Webhook::serving`]).
    pub fn spawn(log: PathBuf, api_port: u16, account: &Path, args: &[OsString]) -> Result<Webhook> {
        let child = Command::new(crate::agent::agent_bin()?)
            .args(["webhook", "--listen", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:0"])
            .args(args)
            .args(["--kube-api", &format!("https://127.0.0.1:{api_port}"), "--kube-token-file"])
            .arg(account.join("token"))
            .arg("--kube-ca-file")
            .arg(account.join("ca.crt"))
            .env("VRAMGUARD_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()?;
        Ok(Webhook { child, log, addr: "0.0.0.0:0".parse()?, metrics: "0.0.0.0:0".parse()? })
    }

    /// Waits until it serves (its addresses in its log); an error if it exits first.
    pub fn serving(mut self) -> Result<Webhook> {
        crate::wait_for(crate::timeout(), "the webhook serves", || {
            if let Some(status) = self.child.try_wait()? {
                bail!("the webhook exited ({status}): {}", self.log());
            }
            let log = self.log();
            let field = |name: &str| log.split_whitespace().find_map(|w| w.strip_prefix(name)).and_then(|a| a.parse::<SocketAddr>().ok());
            match (field("webhook_addr="), field("metrics_addr=")) {
                (Some(addr), Some(metrics)) => {
                    (self.addr, self.metrics) = (addr, metrics);
                    Ok(true)
                }
                _ => Ok(false),
            }
        })?;
        Ok(self)
    }

    /// What it logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `/metrics`'s sample of `series` (a name and its labels as the page writes them).
    pub fn sample(&self, series: &str) -> Result<f64> {
        let (_, page) = crate::http::get(self.metrics, "/metrics")?;
        page.lines()
            .find_map(|line| line.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
            .with_context(|| format!("{series} not on the page:\n{page}"))
    }
}
