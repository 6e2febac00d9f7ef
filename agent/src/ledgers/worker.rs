//! Ledger workers: the only processes of the agent that map a ledger and take its lock.
//!
//! A ledger file is writable by its workload at any moment, and its lock is a glibc robust
//! mutex whose unlock writes through pointers stored in the file; a truncated mapping kills
//! with SIGBUS. So the agent never maps a ledger (`docs/security.md`, rule 1): it reads
//! bounded copies ([`ledger::copy`]) and hands every locked operation (reclaiming a dead
//! process's slot, registering and recharging the agent's own slot) to a worker: a process
//! of its own per ledger, started from the agent's binary (`vramguard ledger-worker`), that
//! confines itself ([`super::sandbox`]: uid nobody, no capabilities, seccomp) before it
//! receives the ledger's descriptor over its socket and maps it.
//!
//! The agent waits at most [`DEADLINE`] for a whole answer, counted from the moment it sends
//! the request (and four times that for the first answer, to the hello, which includes the
//! worker's start): every read of the answer waits only for what is left of that time, so a
//! worker that dribbles its answer a byte at a time is cut off at the deadline like a silent
//! one. A worker that does not answer in time, answers nonsense or a line over 16 KiB, or
//! dies (a signal, a damaged file, one of its resource limits) is killed and reaped, and its
//! ledger gets no worker for a while (`Backoff`): whatever its workload does to the file, the
//! agent spends a bounded time on it and goes on with the other ledgers, and says why. A
//! worker found dead between calls is reaped by the next scan ([`Worker::reap_if_dead`]) and
//! backed off the same way.
//!
//! # Resource limits
//!
//! Every worker runs under `RLIMIT_AS` and `RLIMIT_CPU` ([`WorkerLimits`]), set by the agent
//! in the child between `fork` and `exec` (`pre_exec`), so they hold from the worker's first
//! instruction, before it has seen a byte of the ledger, whatever its own code does (its
//! confinement, [`super::sandbox`], then takes away the capability to raise them and the
//! system calls to try). Setting them in the worker's own confinement would hold as well
//! against a hostile ledger (the worker maps the ledger only after confining itself), but it
//! would leave the limits to the code being limited and to the worker's knowledge of the
//! agent's `--max-ledger-bytes`; the agent knows the figures and the child cannot skip them.
//!
//! - `RLIMIT_AS` = the size of the worker's program file (its loadable segments are no larger;
//!   a debug build's debug info only makes the room more generous) + the largest ledger the
//!   agent allows ([`super::Limits::max_bytes`], `--max-ledger-bytes`, 64 MiB by default: the
//!   worker maps exactly one ledger, whole) + [`WORKER_OVERHEAD`] (64 MiB: the C library and
//!   loader, the stack up to its 8 MiB limit, the heap of a process that holds one 16 KiB line
//!   buffer and a few small values). With the defaults and a ~20 MiB release binary: about
//!   150 MiB of address space. Measured (debug build, a 121 MiB program file, so a 249 MiB
//!   limit): a worker's peak address space (`VmPeak`) was 27 MiB on a 5 MiB container ledger
//!   and 41 MiB on the largest geometry the default limits admit (the hostile suite's, 4,096
//!   slots and 262,144 records). An allocation past the limit fails (the worker aborts:
//!   `SIGABRT`), a mapping past it fails (the worker refuses the ledger); either is reported
//!   like any other worker failure.
//! - `RLIMIT_CPU` = [`WorkerLimits::CPU_SECONDS`] soft (`SIGXCPU`), one more hard (`SIGKILL`).
//!   A worker is single-threaded (it cannot start a thread or process) and is killed when an
//!   answer is late, so one call costs it at most its deadline in CPU time (one second for the
//!   hello, [`DEADLINE`] for an operation). Before each call the agent reads the worker's CPU
//!   time (`/proc/<pid>/stat`) and, once it has used half its limit, stops it quietly and starts
//!   a fresh one: an honest worker, however long it lives, never reaches its
//!   limit (at most half + one second), and one that burns CPU between calls (a worker turned
//!   by its ledger) is killed by the kernel within the limit.
//!
//! The protocol is one JSON line each way per operation; the first message also carries the
//! ledger's descriptor (`SCM_RIGHTS`) and the header the agent validated, which the worker
//! maps the file with: the agent's limits hold whatever the file's own header was rewritten to.
use std::{
    fs::File,
    io::{self, BufRead, BufReader, IoSlice, Read, Write},
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd},
        unix::net::UnixStream,
    },
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use ledger::{layout::Header, Ledger, LedgerError, ProcessIdentity};
use serde::{Deserialize, Serialize};
use tracing::info;

/// How long the agent waits for a worker's answer (the worker itself waits at most
/// [`super::LOCK_WAIT`] for the lock, then answers [`Failure::Busy`]).
pub const DEADLINE: Duration = Duration::from_millis(250);
/// How long the agent waits for the answer to its hello (the worker starts, confines itself
/// and maps the ledger first).
pub const HELLO_DEADLINE: Duration = Duration::from_millis(4 * DEADLINE.as_millis() as u64);
/// The longest line either side accepts.
const MAX_LINE: u64 = 16 << 10;
/// Address space a worker needs besides its program and its ledger (see the module doc).
pub const WORKER_OVERHEAD: u64 = 64 << 20;
/// A worker whose CPU time has reached this fraction of its limit is replaced before its next
/// call (the numerator over 2: half).
const RECYCLE_CPU: u64 = 2;

/// The resource limits every worker runs under (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkerLimits {
    /// `RLIMIT_AS`, in bytes (soft and hard).
    pub address_space: u64,
    /// `RLIMIT_CPU` soft limit in seconds (`SIGXCPU`); the hard limit is one more (`SIGKILL`).
    pub cpu_seconds: u64,
}

impl WorkerLimits {
    /// The CPU time a worker may use in its life, in seconds.
    pub const CPU_SECONDS: u64 = 4;

    /// The limits of a worker run from `program` for ledgers of at most `max_ledger_bytes`.
    pub fn for_program(program: &Path, max_ledger_bytes: u64) -> WorkerLimits {
        // A program that cannot be measured is given the room of a large one.
        let program = std::fs::metadata(program).map(|m| m.len()).unwrap_or(512 << 20);
        WorkerLimits {
            address_space: program.saturating_add(max_ledger_bytes).saturating_add(WORKER_OVERHEAD),
            cpu_seconds: Self::CPU_SECONDS,
        }
    }

    /// CPU time after which a worker is replaced before its next call.
    fn recycle_at(&self) -> Duration {
        Duration::from_secs(self.cpu_seconds) / RECYCLE_CPU as u32
    }

    /// Sets these limits on the calling process. Runs in a forked child before `exec`: only
    /// system calls, no allocation.
    fn apply(&self) -> io::Result<()> {
        let set = |resource, soft: u64, hard: u64| {
            let limit = libc::rlimit { rlim_cur: soft, rlim_max: hard };
            // SAFETY: `limit` is a valid rlimit for the call's duration.
            if unsafe { libc::setrlimit(resource, &limit) } == 0 {
                Ok(())
            } else {
                Err(io::Error::last_os_error())
            }
        };
        // No core dump of a ledger's bytes either (the worker's confinement says so again).
        set(libc::RLIMIT_CORE, 0, 0)?;
        set(libc::RLIMIT_AS, self.address_space, self.address_space)?;
        set(libc::RLIMIT_CPU, self.cpu_seconds, self.cpu_seconds.saturating_add(1))
    }
}

/// A process as the protocol carries it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Process {
    pub pid: u32,
    pub pidns: u64,
    pub start_time: u64,
}

impl From<ProcessIdentity> for Process {
    fn from(p: ProcessIdentity) -> Process {
        Process { pid: p.pid, pidns: p.pidns, start_time: p.start_time }
    }
}

impl From<Process> for ProcessIdentity {
    fn from(p: Process) -> ProcessIdentity {
        ProcessIdentity { pid: p.pid, pidns: p.pidns, start_time: p.start_time }
    }
}

/// What the agent asks a worker.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Request {
    /// [`Ledger::register`].
    Register { process: Process },
    /// [`Ledger::reclaim_process`].
    Reclaim { slot: u32, process: Process },
    /// [`Ledger::recharge`] on `device`.
    Recharge { slot: u32, process: Process, device: u32, previous: Option<u32>, bytes: u64 },
}

/// A worker's answer.
#[derive(Clone, Debug, Serialize, Deserialize)]
enum Reply {
    Ready,
    /// The answer to a hello without a ledger ([`check`]): confined, nothing else to do.
    Confined,
    Slot(u32),
    Reclaimed(Option<u64>),
    Recharged { record: Option<u32>, bytes: u64 },
    Failed(Failure),
}

/// An operation the ledger refused, as the worker reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum Failure {
    #[error("slot {0} is not the one named (freed or reused)")]
    UnknownSlot(u32),
    #[error("its lock stayed held for {}ms", super::LOCK_WAIT.as_millis())]
    Busy,
    #[error("{0}")]
    Ledger(String),
}

/// Why an operation on a ledger did not happen.
#[derive(Debug, thiserror::Error)]
pub enum AccessError {
    #[error("the ledger refused: {0}")]
    Refused(#[from] Failure),
    #[error("the ledger's worker failed: {0}")]
    Worker(String),
    #[error("no operations on this ledger for {}s after its worker failed: {reason}", left.as_secs().max(1))]
    Backoff { left: Duration, reason: String },
}

/// The first message: which ledger this is and the header the agent holds it to.
#[derive(Serialize, Deserialize)]
struct Hello {
    path: PathBuf,
    /// The validated header's bytes (none: a [`check`] of the confinement only).
    header: Vec<u8>,
    lock_wait_ms: u64,
}

/// How a worker is started: the agent's own binary (`/proc/self/exe`, also after the file on
/// disk was replaced by an upgrade) under [`WorkerLimits`], or, in unit tests, a thread
/// serving the protocol in-process (no confinement) or a shell script standing in for a
/// misbehaving worker (a process, under the limits it is given).
#[derive(Clone, Debug)]
pub enum Launcher {
    Exec { program: PathBuf, limits: WorkerLimits },
    #[cfg(test)]
    Thread,
    #[cfg(test)]
    Script { script: String, limits: WorkerLimits },
}

impl Launcher {
    /// How the agent starts the workers of ledgers of at most `max_ledger_bytes`.
    pub fn for_ledgers(max_ledger_bytes: u64) -> Launcher {
        #[cfg(test)]
        {
            let _ = max_ledger_bytes;
            Launcher::Thread
        }
        #[cfg(not(test))]
        {
            let program = PathBuf::from("/proc/self/exe");
            let limits = WorkerLimits::for_program(&program, max_ledger_bytes);
            Launcher::Exec { program, limits }
        }
    }

    /// The agent's program and limits, if workers are the agent's own processes (they are but
    /// in unit tests): those have a [`Spare`].
    fn exec(&self) -> Option<(&Path, &WorkerLimits)> {
        match self {
            Launcher::Exec { program, limits } => Some((program, limits)),
            #[cfg(test)]
            _ => None,
        }
    }

    /// The limits a started worker runs under (none for a thread).
    fn limits(&self) -> Option<WorkerLimits> {
        match self {
            Launcher::Exec { limits, .. } => Some(*limits),
            #[cfg(test)]
            Launcher::Script { limits, .. } => Some(*limits),
            #[cfg(test)]
            Launcher::Thread => None,
        }
    }
}

impl Default for Launcher {
    /// [`Launcher::for_ledgers`] with the default ledger limits.
    fn default() -> Launcher {
        Launcher::for_ledgers(super::Limits::default().max_bytes)
    }
}

/// A running worker for one ledger.
struct Running {
    child: Option<Child>,
    socket: UnixStream,
    reader: BufReader<UnixStream>,
}

/// The agent's handle on the worker of one ledger: started when first needed, restarted
/// after a failure once its backoff has passed.
pub struct Worker {
    launcher: Launcher,
    running: Option<Running>,
    backoff: Backoff,
    /// When the lock was last found held past the wait (reported for [`RECENT`]).
    busy_at: Option<Instant>,
    /// When the running worker last answered.
    used_at: Instant,
}

/// A worker without a request for this long is stopped (started again when needed): ledgers
/// whose processes die rarely keep no process of the agent's resident.
pub const IDLE: Duration = Duration::from_secs(60);

/// How long a lock found held keeps being reported.
const RECENT: Duration = Duration::from_secs(10);

/// Time without a worker after failures: 1 s, doubling to 5 minutes; reset by a success.
#[derive(Default)]
struct Backoff {
    until: Option<Instant>,
    next: Duration,
    reason: String,
}

impl Backoff {
    const FIRST: Duration = Duration::from_secs(1);
    const MAX: Duration = Duration::from_secs(300);

    fn failed(&mut self, reason: String) {
        self.next = if self.next.is_zero() { Self::FIRST } else { (self.next * 2).min(Self::MAX) };
        self.until = Some(Instant::now() + self.next);
        self.reason = reason;
    }

    /// How long the backoff lasts still, if it does.
    fn left(&self) -> Option<Duration> {
        self.until?.checked_duration_since(Instant::now())
    }

    fn waiting(&self) -> Option<AccessError> {
        Some(AccessError::Backoff { left: self.left()?, reason: self.reason.clone() })
    }
}

impl Worker {
    pub fn new(launcher: Launcher) -> Worker {
        Worker { launcher, running: None, backoff: Backoff::default(), busy_at: None, used_at: Instant::now() }
    }

    /// Whether the worker's ledger is backed off: a call now would be refused at once.
    pub fn backed_off(&self) -> bool {
        self.backoff.left().is_some()
    }

    /// The reason of the last failure while its backoff lasts, or a lock found held in the
    /// last `RECENT`.
    pub fn failing(&self) -> Option<String> {
        self.backoff.waiting().map(|_| self.backoff.reason.clone()).or_else(|| {
            let ago = self.busy_at?.elapsed();
            (ago < RECENT).then(|| format!("{} ({}s ago)", Failure::Busy, ago.as_secs()))
        })
    }

    /// The reason of the last failed call if none has succeeded since, its backoff over or
    /// not (for a ledger the agent no longer calls its worker on, e.g. cut: what happened to
    /// the last one).
    pub fn last_failure(&self) -> Option<String> {
        self.backoff.until.map(|_| self.backoff.reason.clone())
    }

    /// Runs `request` on the ledger open as `file` (validated as `header`, named `path`).
    fn call(&mut self, file: &File, header: &Header, path: &Path, request: &Request) -> Result<Reply, AccessError> {
        if let Some(waiting) = self.backoff.waiting() {
            return Err(waiting);
        }
        self.recycle_if_spent();
        let result = self.exchange(file, header, path, request);
        self.used_at = Instant::now();
        if REPLENISH.swap(false, std::sync::atomic::Ordering::AcqRel) {
            prepare_spare(&self.launcher);
        }
        match &result {
            Ok(_) | Err(AccessError::Refused(Failure::UnknownSlot(_))) => self.backoff = Backoff::default(),
            // A lock held past the wait: the worker is fine, but the ledger is left alone for
            // a while like one whose worker failed (a workload that holds its lock must not
            // cost the agent a wait at every pass).
            Err(AccessError::Refused(Failure::Busy)) => {
                self.busy_at = Some(Instant::now());
                self.backoff.failed(Failure::Busy.to_string());
            }
            Err(error) => {
                self.stop();
                self.backoff.failed(error.to_string());
            }
        }
        result
    }

    /// Starts the worker ahead of a call (an exit whose slot the worker is to free next), if
    /// none runs and its ledger is not backed off; a failure is one of the calls' failures
    /// (the ledger backed off, the reason kept).
    pub fn warm(&mut self, file: &File, header: &Header, path: &Path) -> Result<(), AccessError> {
        if let Some(waiting) = self.backoff.waiting() {
            return Err(waiting);
        }
        if self.running.is_some() {
            return Ok(());
        }
        // The spare it takes is replaced after the call it is warmed for (see [`Spare`]).
        let started = self.start(file, header, path);
        self.used_at = Instant::now();
        match started {
            Ok(running) => {
                self.running = Some(running);
                Ok(())
            }
            Err(error) => {
                self.backoff.failed(error.to_string());
                Err(error)
            }
        }
    }

    fn exchange(&mut self, file: &File, header: &Header, path: &Path, request: &Request) -> Result<Reply, AccessError> {
        if self.running.is_none() {
            self.running = Some(self.start(file, header, path)?);
        }
        let running = self.running.as_mut().ok_or_else(|| AccessError::Worker("not running".into()))?;
        let line = serde_json::to_string(request).map_err(|error| AccessError::Worker(error.to_string()))?;
        // The deadline is for the whole answer, from the moment the request goes out.
        let deadline = Instant::now() + DEADLINE;
        let answer = write_line(&mut running.socket, &line, deadline)
            .and_then(|()| read_line(&mut running.reader, deadline, DEADLINE))
            .map_err(|error| AccessError::Worker(self.died(error)))?;
        let reply: Reply = serde_json::from_str(&answer)
            .map_err(|error| AccessError::Worker(format!("answered something that is not a reply ({error})")))?;
        match reply {
            Reply::Failed(failure) => Err(AccessError::Refused(failure)),
            reply => Ok(reply),
        }
    }

    fn start(&mut self, file: &File, header: &Header, path: &Path) -> Result<Running, AccessError> {
        let header = ledger::file::header_bytes(header).to_vec();
        let hello = Hello { path: path.to_path_buf(), header, lock_wait_ms: super::LOCK_WAIT.as_millis() as u64 };
        match launch(&self.launcher, &hello, file)? {
            (running, Reply::Ready) => Ok(running),
            (running, Reply::Failed(failure)) => {
                end(running, io::Error::other("refused"));
                Err(AccessError::Worker(format!("it refused the ledger: {failure}")))
            }
            (running, other) => {
                end(running, io::Error::other("nonsense"));
                Err(AccessError::Worker(format!("it answered {other:?} to its hello")))
            }
        }
    }

    /// The worker is gone or stuck after `error`: kills and reaps it; says how it ended.
    fn died(&mut self, error: io::Error) -> String {
        match self.running.take() {
            Some(running) => end(running, error),
            None => error.to_string(),
        }
    }

    /// Replaces the running worker, quietly (not a failure), once it has used half of its CPU
    /// time limit (see the module doc): an honest worker never reaches the limit.
    fn recycle_if_spent(&mut self) {
        let (Some(limits), Some(pid)) = (self.launcher.limits(), self.pid()) else { return };
        // A worker whose CPU time cannot be read is replaced too.
        if cpu_time(pid).is_none_or(|used| used >= limits.recycle_at()) {
            info!(pid, "replacing a ledger worker that has used half of its CPU time limit");
            self.stop();
        }
    }

    /// A worker that died since its last call (of one of its limits, or anything else) is
    /// reaped, and its ledger backed off like after a failed call; the reason, if it died.
    pub fn reap_if_dead(&mut self) -> Option<String> {
        let running = self.running.as_mut()?;
        let child = running.child.as_mut()?;
        // Still running, or cannot tell (then the next call finds out).
        if !matches!(child.try_wait(), Ok(Some(_))) {
            return None;
        }
        let reason = self.died(io::Error::other("it died between calls"));
        self.backoff.failed(reason.clone());
        Some(reason)
    }

    /// The process id of the running worker, if it is a process.
    pub fn pid(&self) -> Option<u32> {
        self.running.as_ref()?.child.as_ref().map(Child::id)
    }

    /// Stops the worker if it has had no request for `idle` ([`IDLE`] in the agent).
    pub fn stop_if_idle(&mut self, idle: Duration) {
        if self.running.is_some() && self.used_at.elapsed() >= idle {
            self.stop();
        }
    }

    /// Whether a worker process runs.
    pub fn running(&self) -> bool {
        self.running.is_some()
    }

    /// Stops the worker, if one runs.
    pub fn stop(&mut self) {
        if let Some(running) = self.running.take() {
            end(running, io::Error::other("stopped"));
        }
    }

    pub fn register(&mut self, file: &File, header: &Header, path: &Path, process: ProcessIdentity) -> Result<u32, AccessError> {
        match self.call(file, header, path, &Request::Register { process: process.into() })? {
            Reply::Slot(slot) => Ok(slot),
            other => Err(self.unexpected(other)),
        }
    }

    pub fn reclaim(&mut self, file: &File, header: &Header, path: &Path, slot: u32, process: ProcessIdentity) -> Result<Option<u64>, AccessError> {
        match self.call(file, header, path, &Request::Reclaim { slot, process: process.into() })? {
            Reply::Reclaimed(chunks) => Ok(chunks),
            other => Err(self.unexpected(other)),
        }
    }

    /// A [`Request::Recharge`].
    pub fn recharge(&mut self, file: &File, header: &Header, path: &Path, request: &Request) -> Result<(Option<u32>, u64), AccessError> {
        match self.call(file, header, path, request)? {
            Reply::Recharged { record, bytes } => Ok((record, bytes)),
            other => Err(self.unexpected(other)),
        }
    }

    fn unexpected(&mut self, reply: Reply) -> AccessError {
        let reason = format!("answered {reply:?} to another question");
        self.stop();
        self.backoff.failed(reason.clone());
        AccessError::Worker(reason)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Starts a worker the way the agent does and checks that it confines itself (at start-up,
/// so that a node where it cannot, e.g. a container without CAP_SETUID and CAP_SETGID or a
/// runtime seccomp profile that forbids seccomp(2), is refused with the reason rather than
/// found out at the first reclaim).
pub fn check() -> Result<(), AccessError> {
    let fail = |what: &str| AccessError::Worker(format!("a ledger worker cannot start confined: {what}"));
    let hello = Hello { path: PathBuf::new(), header: Vec::new(), lock_wait_ms: 0 };
    let null = File::open("/dev/null").map_err(|e| fail(&e.to_string()))?;
    let (running, reply) = launch(&Launcher::default(), &hello, &null).map_err(|e| fail(&e.to_string()))?;
    end(running, io::Error::other("checked"));
    match reply {
        Reply::Confined => Ok(()),
        Reply::Failed(failure) => Err(fail(&failure.to_string())),
        other => Err(fail(&format!("it answered {other:?} to a check"))),
    }
}

/// Starts a worker with `launcher` (the [`Spare`] if one waits) and sends it `hello` with the
/// descriptor `fd`; the worker and its first answer.
fn launch(launcher: &Launcher, hello: &Hello, fd: &File) -> Result<(Running, Reply), AccessError> {
    if let Some((program, limits)) = launcher.exec() {
        if let Some(spare) = Spare::take(program, limits) {
            let running = Running { reader: BufReader::new(spare.socket.try_clone().map_err(|e| AccessError::Worker(format!("cannot start it: socket: {e}")))?), child: Some(spare.child), socket: spare.socket };
            let greeted = greet(running, hello, fd);
            // Replaced once the call that took it is answered ([`Worker::call`]): the new
            // spare's start (a fork of the agent, an exec, its confinement) then does not
            // compete with that call (a reclaim someone waits for) for the node's CPUs.
            REPLENISH.store(true, std::sync::atomic::Ordering::Release);
            // A spare that died meanwhile is not the ledger's failure: a fresh worker then.
            if greeted.is_ok() {
                return greeted;
            }
        }
    }
    let fail = |what: &str, error: io::Error| AccessError::Worker(format!("cannot start it: {what}: {error}"));
    let (ours, theirs) = UnixStream::pair().map_err(|e| fail("socketpair", e))?;
    let child = match launcher {
        Launcher::Exec { program, limits } => Some(spawn(program, &["ledger-worker"], theirs, limits).map_err(|e| fail("spawn", e))?),
        #[cfg(test)]
        Launcher::Thread => {
            std::thread::spawn(move || serve(theirs, false));
            None
        }
        #[cfg(test)]
        Launcher::Script { script, limits } => {
            Some(spawn(Path::new("/bin/sh"), &["-c", script], theirs, limits).map_err(|e| fail("spawn", e))?)
        }
    };
    let reader = BufReader::new(ours.try_clone().map_err(|e| fail("socket", e))?);
    greet(Running { child, socket: ours, reader }, hello, fd)
}

/// Sends a started worker `hello` with the descriptor `fd`; the worker and its first answer.
fn greet(mut running: Running, hello: &Hello, fd: &File) -> Result<(Running, Reply), AccessError> {
    let line = serde_json::to_string(hello).map_err(|e| AccessError::Worker(e.to_string()))?;
    let deadline = Instant::now() + HELLO_DEADLINE;
    let sent = running.socket.set_write_timeout(Some(HELLO_DEADLINE)).and_then(|()| send_with_fd(&running.socket, &line, fd));
    let answer = match sent.and_then(|()| read_line(&mut running.reader, deadline, HELLO_DEADLINE)) {
        Ok(answer) => answer,
        Err(error) => return Err(AccessError::Worker(end(running, error))),
    };
    match serde_json::from_str::<Reply>(&answer) {
        Ok(reply) => Ok((running, reply)),
        Err(_) => {
            end(running, io::Error::other("nonsense"));
            Err(AccessError::Worker("it answered something that is not a reply".into()))
        }
    }
}

/// A worker started ahead of need: confined, waiting for its hello. The next ledger that needs
/// a worker takes one ([`launch`]) and a new one is started in its place, on a thread of its
/// own, once the call that took it is answered (or by the next scan, [`prepare_spare`]); so a reclaim in a ledger without a running worker (the first in a container, or after
/// [`IDLE`]) waits for a hello, not for a process to start and confine itself. [`SPARES`]
/// wait, so that exits in several such ledgers one after another (a node's pods killed in
/// turn) do not outrun their start; each holds nothing (no ledger, no descriptor but its socket)
/// and ends when the socket closes, the agent's exit included.
struct Spare {
    program: PathBuf,
    limits: WorkerLimits,
    child: Child,
    socket: UnixStream,
}

/// Spare workers kept waiting.
const SPARES: usize = 3;

/// The agent's spare workers, and how many are being started.
static SPARE: std::sync::Mutex<Vec<Spare>> = std::sync::Mutex::new(Vec::new());
/// A spare was taken and is not replaced yet ([`launch`], [`Worker::call`]).
static REPLENISH: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
static STARTING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl Spare {
    /// A spare, if one was started from `program` under `limits` and still runs (the others
    /// taken on the way are ended).
    fn take(program: &Path, limits: &WorkerLimits) -> Option<Spare> {
        loop {
            let mut spare = SPARE.lock().ok()?.pop()?;
            let runs = spare.child.try_wait().ok().flatten().is_none();
            if runs && spare.program == program && spare.limits == *limits {
                return Some(spare);
            }
            let _ = spare.child.kill();
            let _ = spare.child.wait();
        }
    }

    /// Starts spares, each on a thread of its own, until [`SPARES`] wait or are starting.
    pub(super) fn replenish(program: &Path, limits: &WorkerLimits) {
        use std::sync::atomic::Ordering;
        let waiting = SPARE.lock().map_or(SPARES, |spares| spares.len());
        let missing = SPARES.saturating_sub(waiting + STARTING.load(Ordering::Acquire));
        for _ in 0..missing {
            STARTING.fetch_add(1, Ordering::AcqRel);
            let (program, limits) = (program.to_path_buf(), *limits);
            let start = move || {
                let started = UnixStream::pair().ok().and_then(|(ours, theirs)| {
                    let child = spawn(&program, &["ledger-worker"], theirs, &limits).ok()?;
                    Some(Spare { program, limits, child, socket: ours })
                });
                if let Some(mut spare) = started {
                    match SPARE.lock() {
                        Ok(mut spares) if spares.len() < SPARES => spares.push(spare),
                        // Enough wait already.
                        _ => {
                            let _ = spare.child.kill();
                            let _ = spare.child.wait();
                        }
                    }
                }
                STARTING.fetch_sub(1, Ordering::AcqRel);
            };
            if let Err(error) = std::thread::Builder::new().name("vramguard-spare".into()).spawn(start) {
                STARTING.fetch_sub(1, Ordering::AcqRel);
                tracing::warn!(%error, "cannot start a thread to start a spare ledger worker");
                return;
            }
        }
    }
}

/// Has a spare worker started for `launcher`'s workers (see [`Spare`]), if it starts processes.
pub fn prepare_spare(launcher: &Launcher) {
    if let Some((program, limits)) = launcher.exec() {
        Spare::replenish(program, limits);
    }
}

/// Starts `program` with `args` under `limits`, `socket` as its standard input.
fn spawn(program: &Path, args: &[&str], socket: UnixStream, limits: &WorkerLimits) -> io::Result<Child> {
    use std::os::unix::process::CommandExt;
    let mut command = Command::new(program);
    command.args(args).env_clear().stdin(Stdio::from(OwnedFd::from(socket))).stdout(Stdio::null()).stderr(Stdio::null());
    let limits = *limits;
    // SAFETY: the closure runs in the forked child before exec; it makes two setrlimit calls
    // (async-signal-safe) and allocates nothing.
    unsafe { command.pre_exec(move || limits.apply()) };
    command.spawn()
}

/// The CPU time (user and system) process `pid` has used, from `/proc/<pid>/stat`.
fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command name (which may hold spaces and parentheses): state is
    // field 3, utime and stime fields 14 and 15.
    let mut fields = stat.rsplit_once(')')?.1.split_whitespace().skip(11);
    let ticks = fields.next()?.parse::<u64>().ok()? + fields.next()?.parse::<u64>().ok()?;
    // SAFETY: sysconf with a valid name.
    let per_second = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).ok().filter(|t| *t > 0)?;
    Some(Duration::from_millis(ticks.saturating_mul(1000) / per_second))
}

/// Kills and reaps a worker after `error` (what went wrong talking to it); says how it ended.
fn end(mut running: Running, error: io::Error) -> String {
    let _ = running.socket.shutdown(std::net::Shutdown::Both);
    let Some(mut child) = running.child.take() else { return error.to_string() };
    let timed_out = matches!(error.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut);
    // Already gone (a crash) or not: its status tells which.
    let exited = child.try_wait().ok().flatten();
    let _ = child.kill();
    let status = exited.or_else(|| child.wait().ok());
    let signal = status.and_then(|s| std::os::unix::process::ExitStatusExt::signal(&s));
    match (exited, signal, status.and_then(|s| s.code())) {
        (_, Some(signal), _) if signal != libc::SIGKILL => format!("it died of signal {signal} ({})", signal_name(signal)),
        (Some(_), Some(_), _) => "it was killed (SIGKILL, not by the agent: its hard CPU time limit, or the kernel's OOM killer)".into(),
        (Some(_), _, Some(code)) => format!("it exited with status {code} ({error})"),
        _ if timed_out => format!("{error} (killed)"),
        _ => format!("it stopped answering ({error}; killed)"),
    }
}

fn signal_name(signal: i32) -> &'static str {
    match signal {
        libc::SIGBUS => "SIGBUS: the file was cut under its mapping",
        libc::SIGSEGV => "SIGSEGV: damaged bookkeeping",
        libc::SIGSYS => "SIGSYS: a forbidden system call",
        libc::SIGXCPU => "SIGXCPU: over its CPU time limit, RLIMIT_CPU",
        libc::SIGABRT => "SIGABRT",
        _ => "a signal",
    }
}

/// Writes `line` and its newline, giving up at `deadline`.
fn write_line(socket: &mut UnixStream, line: &str, deadline: Instant) -> io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::Error::new(io::ErrorKind::TimedOut, "no time left to send the request"));
    }
    socket.set_write_timeout(Some(left))?;
    socket.write_all(format!("{line}\n").as_bytes())
}

/// One line (without its newline), whole by `deadline` (`wait` after the request: named in
/// the error), however it arrives: each read waits only for the time left. A line longer
/// than [`MAX_LINE`] (its newline included), not UTF-8, or an end of file is an error.
fn read_line(reader: &mut BufReader<UnixStream>, deadline: Instant, wait: Duration) -> io::Result<String> {
    let late = || io::Error::new(io::ErrorKind::TimedOut, format!("no whole answer within {}ms", wait.as_millis()));
    let too_long = || io::Error::new(io::ErrorKind::InvalidData, "a line too long");
    let max = MAX_LINE as usize;
    let mut line = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(late());
        }
        reader.get_ref().set_read_timeout(Some(left))?;
        let available = match reader.fill_buf() {
            Ok(available) => available,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
            Err(error) if matches!(error.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => return Err(late()),
            Err(error) => return Err(error),
        };
        if available.is_empty() {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the worker closed its socket"));
        }
        if let Some(end) = available.iter().position(|byte| *byte == b'\n') {
            if line.len() + end + 1 > max {
                return Err(too_long());
            }
            line.extend_from_slice(&available[..end]);
            reader.consume(end + 1);
            break;
        }
        // No newline yet: what came must leave room for one.
        let taken = available.len();
        if line.len() + taken + 1 > max {
            return Err(too_long());
        }
        line.extend_from_slice(available);
        reader.consume(taken);
    }
    String::from_utf8(line).map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "a line that is not UTF-8"))
}

fn send_with_fd(socket: &UnixStream, line: &str, file: &File) -> io::Result<()> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let bytes = format!("{line}\n");
    let fds = [file.as_raw_fd()];
    let sent = sendmsg::<()>(socket.as_raw_fd(), &[IoSlice::new(bytes.as_bytes())], &[ControlMessage::ScmRights(&fds)], MsgFlags::empty(), None)
        .map_err(io::Error::from)?;
    if sent != bytes.len() {
        return Err(io::Error::new(io::ErrorKind::WriteZero, "the first message went out cut"));
    }
    Ok(())
}

/// The first message and the descriptor it carries.
fn receive_with_fd(socket: &UnixStream) -> io::Result<(String, File)> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    let mut buffer = vec![0u8; MAX_LINE as usize];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
    let mut iov = [io::IoSliceMut::new(&mut buffer)];
    let message = recvmsg::<()>(socket.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC).map_err(io::Error::from)?;
    let mut file = None;
    for control in message.cmsgs().map_err(io::Error::from)? {
        if let ControlMessageOwned::ScmRights(fds) = control {
            for fd in fds {
                // SAFETY: the kernel just installed `fd` in this process for this message;
                // nothing else owns it.
                let owned = unsafe { File::from_raw_fd(fd) };
                if file.is_none() {
                    file = Some(owned);
                }
            }
        }
    }
    let length = message.bytes;
    let text = String::from_utf8_lossy(&buffer[..length]).trim_end().to_string();
    let file = file.ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "the first message carried no descriptor"))?;
    Ok((text, file))
}

/// `vramguard ledger-worker`: confines this process, then serves the agent on standard input
/// (a socket) until it closes. Returns the exit status.
pub fn main() -> i32 {
    // SAFETY: fd 0 is the socket the agent passed as standard input; this process owns it.
    let socket = unsafe { UnixStream::from_raw_fd(0) };
    serve(socket, true)
}

/// The worker's loop. `confine`: apply [`super::sandbox::confine`] first (always, but in
/// the agent's unit tests, where the worker is a thread of the test process).
fn serve(socket: UnixStream, confine: bool) -> i32 {
    let reply = |socket: &mut UnixStream, reply: &Reply| {
        serde_json::to_string(reply).map_err(io::Error::other).and_then(|line| socket.write_all(format!("{line}\n").as_bytes()))
    };
    let mut writer = match socket.try_clone() {
        Ok(writer) => writer,
        Err(_) => return 2,
    };
    if confine {
        if let Err(error) = super::sandbox::confine() {
            let _ = reply(&mut writer, &Reply::Failed(Failure::Ledger(format!("cannot confine itself: {error}"))));
            return 2;
        }
    }
    let (hello, file) = match receive_with_fd(&socket) {
        Ok(first) => first,
        Err(_) => return 2,
    };
    let Ok(hello) = serde_json::from_str::<Hello>(&hello) else {
        let _ = reply(&mut writer, &Reply::Failed(Failure::Ledger("a first message that is not a hello".into())));
        return 2;
    };
    if hello.header.is_empty() {
        let _ = reply(&mut writer, &Reply::Confined);
        return 0;
    }
    let Some(header) = ledger::file::header_from_bytes(&hello.header) else {
        let _ = reply(&mut writer, &Reply::Failed(Failure::Ledger("a hello without a header".into())));
        return 2;
    };
    let ledger = match Ledger::from_file_as(&file, header, &hello.path) {
        Ok(ledger) => ledger,
        Err(error) => {
            let _ = reply(&mut writer, &Reply::Failed(Failure::Ledger(error.to_string())));
            return 2;
        }
    };
    let ledger = ledger.with_lock_timeout(Duration::from_millis(hello.lock_wait_ms));
    if reply(&mut writer, &Reply::Ready).is_err() {
        return 2;
    }
    let mut reader = BufReader::new(socket);
    // No deadlines on this side: the agent closes the socket when it is done (or dies).
    loop {
        let mut line = String::new();
        match reader.by_ref().take(MAX_LINE).read_line(&mut line) {
            Ok(0) | Err(_) => return 0,
            Ok(_) => {}
        }
        let answer = match serde_json::from_str::<Request>(&line) {
            Ok(request) => perform(&ledger, request),
            Err(error) => Reply::Failed(Failure::Ledger(format!("not a request: {error}"))),
        };
        if reply(&mut writer, &answer).is_err() {
            return 0;
        }
    }
}

fn perform(ledger: &Ledger, request: Request) -> Reply {
    let result = match request {
        Request::Register { process } => ledger.register(process.into()).map(Reply::Slot),
        Request::Reclaim { slot, process } => ledger.reclaim_process(slot, process.into()).map(Reply::Reclaimed),
        Request::Recharge { slot, process, device, previous, bytes } => ledger
            .recharge(slot, process.into(), device, previous, bytes)
            .map(|(record, bytes)| Reply::Recharged { record, bytes }),
    };
    result.unwrap_or_else(|error| {
        Reply::Failed(match error {
            LedgerError::UnknownSlot(slot) => Failure::UnknownSlot(slot),
            LedgerError::Busy { .. } => Failure::Busy,
            other => Failure::Ledger(other.to_string()),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ledger::{layout::CREATOR_AGENT, DeviceConfig, Geometry};

    /// A ledger in a directory of its own, for calls the stand-ins ignore.
    struct Scratch {
        dir: PathBuf,
        path: PathBuf,
        file: File,
        header: Header,
    }

    impl Scratch {
        fn new(tag: &str) -> Scratch {
            let dir = std::env::temp_dir().join(format!("vramguard-worker-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("mkdir");
            let path = dir.join("ledger");
            let geometry = Geometry { slots: 4, records: 16, devices: vec![DeviceConfig { limit: 64 << 20, chunk: 2 << 20, ..Default::default() }] };
            let header = *Ledger::create(&path, &geometry, CREATOR_AGENT).expect("create").header();
            let file = File::open(&path).expect("open");
            Scratch { dir, path, file, header }
        }

        fn register(&self, worker: &mut Worker) -> Result<u32, AccessError> {
            worker.register(&self.file, &self.header, &self.path, ProcessIdentity { pid: 1, pidns: 1, start_time: 1 })
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    fn limits() -> WorkerLimits {
        WorkerLimits::for_program(Path::new("/bin/sh"), super::super::Limits::default().max_bytes)
    }

    /// A stand-in worker: a shell running `body` after the hello, answered `"Ready"`.
    fn stand_in(body: &str, limits: WorkerLimits) -> Worker {
        let script = format!("exec 1>&0; PATH=/usr/bin:/bin; read -r hello; echo '\"Ready\"'; {body}");
        Worker::new(Launcher::Script { script, limits })
    }

    /// Answers its first request at once, then its second after `before_second` (shell).
    fn second_answer_after(before_second: &str) -> Worker {
        stand_in(&format!("read -r r; echo '{{\"Slot\":1}}'; read -r r; {before_second} echo '{{\"Slot\":2}}'; read -r r"), limits())
    }

    /// Twenty spaces (JSON allows them before a value), one every 200 ms: each read finds a
    /// byte well within 250 ms, the whole answer takes four seconds.
    const DRIBBLE: &str = "for i in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do printf ' '; sleep 0.2; done;";

    fn gone(pid: u32) -> bool {
        !Path::new(&format!("/proc/{pid}")).exists()
    }

    #[test]
    fn a_dribbled_answer_is_cut_off_at_the_deadline_and_its_worker_reaped() {
        let scratch = Scratch::new("dribble");
        let mut worker = second_answer_after(DRIBBLE);
        assert_eq!(scratch.register(&mut worker).expect("first answer"), 1);
        let pid = worker.pid().expect("a process");
        let start = Instant::now();
        let error = scratch.register(&mut worker).expect_err("a dribbled answer");
        let took = start.elapsed();
        assert!(took < Duration::from_secs(2), "the call returned after {took:?}");
        assert!(took >= DEADLINE, "the call returned before its deadline: {took:?}");
        let text = error.to_string();
        assert!(matches!(error, AccessError::Worker(_)) && text.contains("no whole answer within 250ms (killed)"), "{text}");
        assert!(gone(pid), "the dribbling worker {pid} was not killed and reaped");
        assert!(!worker.running());
        assert!(worker.failing().is_some_and(|reason| reason.contains("no whole answer within 250ms")));
        assert!(matches!(scratch.register(&mut worker), Err(AccessError::Backoff { .. })), "backed off");
    }

    #[test]
    fn negative_control_a_prompt_stand_in_answers() {
        let scratch = Scratch::new("prompt");
        let mut worker = second_answer_after("printf '   ';");
        assert_eq!(scratch.register(&mut worker).expect("first answer"), 1);
        let pid = worker.pid().expect("a process");
        assert_eq!(scratch.register(&mut worker).expect("second answer"), 2);
        assert_eq!(worker.pid(), Some(pid));
        assert_eq!(worker.failing(), None);
    }

    #[test]
    fn a_dribbled_hello_is_cut_off_at_its_deadline() {
        let scratch = Scratch::new("hello");
        let script = format!("exec 1>&0; PATH=/usr/bin:/bin; read -r hello; {DRIBBLE} echo '\"Ready\"'; read -r r");
        let mut worker = Worker::new(Launcher::Script { script, limits: limits() });
        let start = Instant::now();
        let error = scratch.register(&mut worker).expect_err("a dribbled hello");
        let took = start.elapsed();
        assert!(took < Duration::from_secs(2), "the call returned after {took:?}");
        assert!(error.to_string().contains("no whole answer within 1000ms (killed)"), "{error}");
    }

    #[test]
    fn a_worker_runs_under_its_address_space_and_cpu_limits() {
        let scratch = Scratch::new("rlimits");
        let limits = limits();
        let mut worker = stand_in("read -r r; echo '{\"Slot\":1}'; read -r r", limits);
        assert_eq!(scratch.register(&mut worker).expect("answer"), 1);
        let pid = worker.pid().expect("a process");
        let table = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("limits");
        let row = |name: &str| -> Vec<String> {
            let line = table.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("{name} in {table}"));
            line[name.len()..].split_whitespace().map(str::to_string).collect()
        };
        let bytes = limits.address_space.to_string();
        assert_eq!(row("Max address space")[..2], [bytes.clone(), bytes]);
        assert_eq!(row("Max cpu time")[..2], ["4".to_string(), "5".to_string()]);
        assert_eq!(row("Max core file size")[..2], ["0".to_string(), "0".to_string()]);
        // Room for the program, the largest ledger allowed and the overhead.
        let program = std::fs::metadata("/bin/sh").expect("sh").len();
        assert_eq!(limits.address_space, program + (64 << 20) + WORKER_OVERHEAD);
    }

    /// Waits up to thirty seconds for `done` (a CPU-bound stand-in on a loaded machine).
    fn within_thirty_seconds(what: &str, mut done: impl FnMut() -> bool) {
        let start = Instant::now();
        while !done() {
            assert!(start.elapsed() < Duration::from_secs(30), "{what}: not within 30 s");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    #[test]
    fn a_worker_over_its_cpu_limit_is_killed_reaped_and_restarted_after_its_backoff() {
        let scratch = Scratch::new("spin");
        // Answers, then spins between calls (what a worker turned by its ledger could do).
        let mut worker = stand_in("read -r r; echo '{\"Slot\":1}'; while :; do :; done", WorkerLimits { cpu_seconds: 1, ..limits() });
        assert_eq!(scratch.register(&mut worker).expect("answer"), 1);
        let pid = worker.pid().expect("a process");
        let mut reason = None;
        within_thirty_seconds("the spinning worker killed by RLIMIT_CPU and reaped", || {
            reason = worker.reap_if_dead();
            reason.is_some()
        });
        let reason = reason.unwrap_or_default();
        assert!(reason.contains("SIGXCPU"), "{reason}");
        assert!(gone(pid) && !worker.running());
        assert_eq!(worker.failing().as_deref(), Some(reason.as_str()));
        assert!(matches!(scratch.register(&mut worker), Err(AccessError::Backoff { .. })), "backed off");
        std::thread::sleep(Backoff::FIRST);
        assert_eq!(scratch.register(&mut worker).expect("a fresh worker answers"), 1);
        assert!(worker.pid().is_some_and(|fresh| fresh != pid));
        assert_eq!(worker.failing(), None);
    }

    #[test]
    fn a_worker_near_its_cpu_limit_is_replaced_quietly_before_its_next_call() {
        let scratch = Scratch::new("recycle");
        // Answers, then uses 1.1 s of CPU (a long life of honest calls), then would answer.
        let burn = "while :; do read -r s < /proc/$$/stat; set -- $s; [ $(( ${14} + ${15} )) -ge 110 ] && break; done;";
        let mut worker = stand_in(&format!("read -r r; echo '{{\"Slot\":1}}'; {burn} read -r r; echo '{{\"Slot\":2}}'; read -r r"), WorkerLimits { cpu_seconds: 2, ..limits() });
        assert_eq!(scratch.register(&mut worker).expect("answer"), 1);
        let pid = worker.pid().expect("a process");
        within_thirty_seconds("the worker uses half its CPU limit", || cpu_time(pid).is_some_and(|used| used >= Duration::from_secs(1)));
        // Replaced, not asked: the fresh worker's first answer, no failure, no backoff.
        assert_eq!(scratch.register(&mut worker).expect("a fresh worker answers"), 1);
        assert!(gone(pid), "the old worker {pid} was not reaped");
        assert!(worker.pid().is_some_and(|fresh| fresh != pid));
        assert_eq!(worker.failing(), None);
    }
}
