//! A `vramguard run` started for one test: probes the fake driver only, listens on a socket
//! of its own, and is stopped with SIGTERM (which must succeed) or killed on drop.
use std::{
    ffi::{OsStr, OsString},
    fs::File,
    path::{Path, PathBuf},
    sync::atomic::{AtomicU32, Ordering},
    process::{Child, Command, Output, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::target_dir;

/// The agent binary built by the workspace.
pub fn agent_bin() -> Result<PathBuf> {
    let path = target_dir()?.join("vramguard");
    if !path.exists() {
        bail!("{} is not built: run the tests with `cargo xtask test`", path.display());
    }
    Ok(path)
}

/// The arguments that make `vramguard run` containerd's NRI plugin on `nri_socket`,
/// provisioning from `quota_file` with the built hook, its state under `state_dir`, on a node
/// of `gpu_memory` per GPU (e.g. `8g`): `--nri --nri-socket ... --gpu-memory ...`.
pub fn provisioning_args(nri_socket: &Path, state_dir: &Path, quota_file: &Path, gpu_memory: &str) -> Result<Vec<OsString>> {
    Ok(vec![
        "--nri".into(),
        "--nri-socket".into(),
        nri_socket.into(),
        "--state-dir".into(),
        state_dir.into(),
        "--hook-library".into(),
        crate::hook_lib()?.into(),
        "--quota-file".into(),
        quota_file.into(),
        "--gpu-memory".into(),
        gpu_memory.into(),
    ])
}

/// The arguments of an agent on the fake driver (discovery off) that is containerd's NRI
/// plugin on `<dir>/nri.sock` with `--kube` for quotas, its ledgers under `<dir>/ledgers`, its
/// state in `<dir>/state`, the built hook, a node of `gpu_memory` (e.g. `8g` or `8Gi,8Gi`), and
/// metrics on a free loopback port: what the tests against the tests' API server start from
/// (the API server's address comes from the pod's environment).
pub fn kube_node_args(dir: &Path, gpu_memory: &str) -> Result<Vec<OsString>> {
    Ok(vec![
        "--libcuda".into(),
        crate::fake_driver_dir()?.join("libcuda.so.1").into(),
        "--no-discover".into(),
        "--ledger-dir".into(),
        dir.join("ledgers").into(),
        "--metrics-addr".into(),
        "127.0.0.1:0".into(),
        "--nri".into(),
        "--nri-socket".into(),
        dir.join("nri.sock").into(),
        "--state-dir".into(),
        dir.join("state").into(),
        "--hook-library".into(),
        crate::hook_lib()?.into(),
        "--gpu-memory".into(),
        gpu_memory.into(),
        "--kube".into(),
    ])
}

pub struct Agent {
    child: Option<Child>,
    socket: PathBuf,
    dir: PathBuf,
}

/// The arguments of an agent on the fake driver `libcuda` that watches the ledgers under `dir`
/// and serves metrics and health on free loopback ports (discovery on): what the driver view's
/// tests and the node agent's benchmark start from.
pub fn watching_args<'a>(libcuda: &'a Path, dir: &'a Path) -> Vec<&'a OsStr> {
    vec![
        OsStr::new("--libcuda"),
        libcuda.as_os_str(),
        OsStr::new("--ledger-dir"),
        dir.as_os_str(),
        OsStr::new("--metrics-addr"),
        OsStr::new("127.0.0.1:0"),
        OsStr::new("--health-addr"),
        OsStr::new("127.0.0.1:0"),
    ]
}

impl Agent {
    /// Starts the agent on `libcuda` alone and waits until it answers on its socket.
    pub fn start(libcuda: &Path) -> Result<Agent> {
        Self::start_with(&[OsStr::new("--libcuda"), libcuda.as_os_str(), OsStr::new("--no-discover")])
    }

    /// Starts the agent on the fake driver alone (`--libcuda <fake> --no-discover`) with
    /// these further arguments.
    pub fn start_on_fake_driver(args: &[&OsStr]) -> Result<Agent> {
        let libcuda = crate::fake_driver_dir()?.join("libcuda.so.1");
        let mut all: Vec<&OsStr> = vec![OsStr::new("--libcuda"), libcuda.as_os_str(), OsStr::new("--no-discover")];
        all.extend_from_slice(args);
        Self::start_with(&all)
    }

    /// [`Agent::start_on_fake_driver`] watching the ledgers under `dir` (`--ledger-dir`) and
    /// serving metrics on a free local port (`--metrics-addr 127.0.0.1:0`), followed by
    /// `more` arguments: how the DaemonSet runs it.
    pub fn watching(dir: &Path, more: &[&OsStr]) -> Result<Agent> {
        Agent::watching_node(dir, more, &[])
    }

    /// [`Agent::watching`] with `env` set for the agent too (a [`crate::FakeNode::env`]: its
    /// NVML, which sizes the node's GPUs, then sees that node's devices).
    pub fn watching_node(dir: &Path, more: &[&OsStr], env: &[(OsString, OsString)]) -> Result<Agent> {
        let libcuda = crate::fake_driver_dir()?.join("libcuda.so.1");
        let mut args = vec![OsStr::new("--libcuda"), libcuda.as_os_str(), OsStr::new("--no-discover")];
        args.extend([OsStr::new("--ledger-dir"), dir.as_os_str(), OsStr::new("--metrics-addr"), OsStr::new("127.0.0.1:0")]);
        args.extend_from_slice(more);
        Agent::start_with_env(&args, env)
    }

    /// Starts `vramguard run` with these arguments (and a socket of its own) and waits until
    /// it answers on its socket.
    pub fn start_with(args: &[&OsStr]) -> Result<Agent> {
        Self::start_binary(&agent_bin()?, args)
    }

    /// [`Agent::start_with`] for the agent binary at `bin` (e.g. a release build, where the
    /// tests' profile is another); `vramguard audit` still comes from the tests' profile.
    pub fn start_binary(bin: &Path, args: &[&OsStr]) -> Result<Agent> {
        Self::start_binary_env(bin, args, &[])
    }

    /// [`Agent::start_with`] with these variables set for the agent too (e.g. a
    /// [`crate::FakeNode::env`], so that the fake NVML it loads sees that node's devices).
    pub fn start_with_env(args: &[&OsStr], env: &[(OsString, OsString)]) -> Result<Agent> {
        Self::start_binary_env(&agent_bin()?, args, env)
    }

    /// [`Agent::start_binary`] with these variables set for the agent too.
    pub fn start_binary_env(bin: &Path, args: &[&OsStr], env: &[(OsString, OsString)]) -> Result<Agent> {
        if std::env::var_os(crate::SHARED_NODE).is_some() && !args.contains(&OsStr::new("--no-discover")) {
            bail!(
                "this agent discovers libcuda on the whole node (no --no-discover) while other test binaries run \
                 beside this one, whose fake drivers it would find: mark the test `/// Runs alone: <why>`"
            );
        }
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "vramguard-agent-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir)?;
        let socket = dir.join("agent.sock");
        // A file, not a pipe: a pipe nobody reads would block the agent once full.
        let log = File::create(dir.join("agent.log"))?;
        let child = Command::new(bin)
            .arg("run")
            .arg("--socket")
            .arg(&socket)
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("cannot start vramguard run")?;
        let mut agent = Agent { child: Some(child), socket, dir };
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if agent.try_audit().is_ok() {
                return Ok(agent);
            }
            if let Some(status) = agent.child_mut().try_wait()? {
                bail!("vramguard run exited ({status}) before it was ready: {}", agent.stderr());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!("vramguard run did not answer within 30 s: {}", agent.stderr())
    }

    fn child_mut(&mut self) -> &mut Child {
        self.child.as_mut().expect("the child is present until stop or drop")
    }

    fn try_audit(&self) -> Result<Value> {
        let output = self.audit_command().output()?;
        if !output.status.success() {
            bail!("vramguard audit failed: {}", String::from_utf8_lossy(&output.stderr));
        }
        Ok(serde_json::from_slice(&output.stdout)?)
    }

    fn audit_command(&self) -> Command {
        let mut command = Command::new(agent_bin().unwrap_or_else(|_| PathBuf::from("vramguard")));
        command.args(["audit", "--json", "--socket"]).arg(&self.socket);
        command
    }

    /// Counter `name` of an audit's `stats` (`u64::MAX` when it is missing, so a comparison
    /// with a real figure fails).
    pub fn stat(audit: &Value, name: &str) -> u64 {
        audit["stats"][name].as_u64().unwrap_or(u64::MAX)
    }

    /// Waits up to `within` for the agent's count of allocation records to be `expected`
    /// (the sweep after an exit deletes a dead process's records); the audit that said so.
    pub fn records_settle(&self, expected: u64, within: Duration) -> Result<Value> {
        let start = Instant::now();
        loop {
            let audit = self.audit()?;
            if Self::stat(&audit, "records") == expected {
                return Ok(audit);
            }
            if start.elapsed() > within {
                bail!("{} records, not {expected}, after {within:?}: {}", Self::stat(&audit, "records"), audit["stats"]);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `vramguard audit --json` against this agent, parsed.
    pub fn audit(&self) -> Result<Value> {
        self.try_audit()
    }

    /// `vramguard audit` (the table) against this agent.
    pub fn audit_table(&self) -> Result<Output> {
        let mut command = Command::new(agent_bin()?);
        command.args(["audit", "--socket"]).arg(&self.socket);
        Ok(command.output()?)
    }

    /// Where the agent serves its metrics (started with `--metrics-addr`), as it reports it.
    pub fn metrics_addr(&self) -> Result<std::net::SocketAddr> {
        let audit = self.audit()?;
        let text = audit["metrics_addr"].as_str().context("the agent serves no metrics (no --metrics-addr)")?;
        text.parse().with_context(|| format!("bad metrics address {text:?}"))
    }

    /// Where the agent serves `/healthz` and `/readyz` on their own listener (started with
    /// `--health-addr`), as it reports it.
    pub fn health_addr(&self) -> Result<std::net::SocketAddr> {
        let audit = self.audit()?;
        let text = audit["health_addr"].as_str().context("the agent serves no health listener (no --health-addr)")?;
        text.parse().with_context(|| format!("bad health address {text:?}"))
    }

    /// The agent's process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// The agent's control socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The directory made for this agent (its socket and log), removed when it is dropped.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Stops the agent with SIGTERM; fails unless it exits successfully within 10 s (of the
    /// SIGTERM, sent once no other agent stops: [`stopping_alone`]).
    pub fn stop(mut self) -> Result<String> {
        let _alone = stopping_alone()?;
        let mut child = self.child.take().expect("the child is present until stop or drop");
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = child.try_wait()? {
                let stderr = self.log();
                if !status.success() {
                    bail!("vramguard run exited with {status} on SIGTERM: {stderr}");
                }
                return Ok(stderr);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                bail!("vramguard run did not stop within 10 s of SIGTERM; its log:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits up to `limit` for the agent to exit by itself: its status, and how long it took.
    pub fn wait_exit(&mut self, limit: Duration) -> Result<(std::process::ExitStatus, Duration)> {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child_mut().try_wait()? {
                return Ok((status, start.elapsed()));
            }
            if start.elapsed() > limit {
                bail!("vramguard run still runs {limit:?} later: {}", self.log());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Sends SIGTERM and waits up to `limit` for the agent to exit, whatever its status (once no
    /// other agent stops: [`stopping_alone`]).
    pub fn terminate(&mut self, limit: Duration) -> Result<(std::process::ExitStatus, Duration)> {
        let _alone = stopping_alone()?;
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.pid() as i32, libc::SIGTERM) };
        self.wait_exit(limit)
    }

    /// Stops the agent if it still runs and returns what it logged.
    fn stderr(&mut self) -> String {
        let child = self.child_mut();
        if child.try_wait().ok().flatten().is_none() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.log()
    }

    /// What the agent has logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default()
    }

    /// The agent's line about the reclaim of process `pid` (a host pid), waited for up to a
    /// second. Its fields say what freed it and from when its latency runs: `by="exit path"`
    /// (the process's pidfd or exit event woke the exit path, which logs once the event came
    /// or 100 ms later), else the reclaim task's sweeps; `from_exit_event=true` when its exit
    /// event came in time (the latency runs from it), `false` when it did not (on two busy
    /// CPUs an event can come later than the pidfd).
    pub fn reclaim_line(&self, pid: u32) -> Result<String> {
        let host_pid = format!("host_pid={pid} ");
        let find = || {
            self.log()
                .lines()
                .find(|line| line.contains("reclaimed the slot of a process that is gone") && line.contains(&host_pid))
                .map(str::to_string)
        };
        crate::wait_for(Duration::from_secs(1), "the reclaim of a killed process", || Ok(find().is_some()))
            .with_context(|| format!("no reclaim of {pid} logged: {}", self.log()))?;
        find().context("the reclaim's line went away")
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _alone = stopping_alone();
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Waits until no other test's agent on this node stops, and holds that until dropped (an
/// exclusive `flock` on `target/<profile>/.agent-stop.lock`).
///
/// An agent's stop is mostly the kernel's: it removes each tracepoint link (9), and each probe
/// where they are perf events (28 for a libcuda, `--uprobe-links perf`), under one mutex of
/// its own, waiting a grace period each (about 70-110 ms), so agents stopping at once on one
/// node queue behind each other's. A node has one agent; so does each measured stop.
pub fn stopping_alone() -> Result<File> {
    let path = crate::target_dir()?.join(".agent-stop.lock");
    let lock = File::options().create(true).truncate(false).write(true).open(&path).with_context(|| format!("cannot open {}", path.display()))?;
    loop {
        // SAFETY: flock(2) on a descriptor this function owns.
        if unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX) } == 0 {
            return Ok(lock);
        }
        let error = std::io::Error::last_os_error();
        if error.kind() != std::io::ErrorKind::Interrupted {
            return Err(error).with_context(|| format!("cannot lock {}", path.display()));
        }
    }
}
