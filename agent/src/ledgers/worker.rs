//! Ledger workers: the only processes of the agent that map a ledger and take its lock.
//!
//! A ledger file is writable by its workload at any moment, and its lock is a glibc robust
//! mutex whose unlock writes through pointers stored in the file; a truncated mapping kills
//! with SIGBUS. So the agent never maps a ledger (`../shared/security.md`, rule 1): it reads
//! bounded copies ([`ledger::copy`]) and hands every locked operation (reclaiming a dead
//! process's slot, registering and recharging the agent's own slot) to a worker: a process
//! of its own per ledger, started from the agent's binary (`vramguard ledger-worker`), that
//! confines itself ([`super::sandbox`]: uid nobody, no capabilities, seccomp) before it
//! receives the ledger's descriptor over its socket and maps it.
//!
//! The agent waits at most [`DEADLINE`] for an answer. A worker that does not answer in time,
//! answers nonsense, or dies (a signal, a damaged file) is killed and reaped, and its ledger
//! gets no worker for a while (`Backoff`): whatever its workload does to the file, the agent
//! spends a bounded time on it and goes on with the other ledgers, and says why.
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

/// How long the agent waits for a worker's answer (the worker itself waits at most
/// [`super::LOCK_WAIT`] for the lock, then answers [`Failure::Busy`]).
pub const DEADLINE: Duration = Duration::from_millis(250);
/// The longest line either side accepts.
const MAX_LINE: u64 = 16 << 10;

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
/// disk was replaced by an upgrade), or, in unit tests, a thread serving the protocol
/// in-process (no confinement).
#[derive(Clone, Debug)]
pub enum Launcher {
    Exec(PathBuf),
    #[cfg(test)]
    Thread,
}

impl Default for Launcher {
    fn default() -> Launcher {
        #[cfg(test)]
        return Launcher::Thread;
        #[cfg(not(test))]
        Launcher::Exec(PathBuf::from("/proc/self/exe"))
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

    fn waiting(&self) -> Option<AccessError> {
        let left = self.until?.checked_duration_since(Instant::now())?;
        Some(AccessError::Backoff { left, reason: self.reason.clone() })
    }
}

impl Worker {
    pub fn new(launcher: Launcher) -> Worker {
        Worker { launcher, running: None, backoff: Backoff::default(), busy_at: None, used_at: Instant::now() }
    }

    /// The reason of the last failure while its backoff lasts, or a lock found held in the
    /// last `RECENT`.
    pub fn failing(&self) -> Option<String> {
        self.backoff.waiting().map(|_| self.backoff.reason.clone()).or_else(|| {
            let ago = self.busy_at?.elapsed();
            (ago < RECENT).then(|| format!("{} ({}s ago)", Failure::Busy, ago.as_secs()))
        })
    }

    /// Runs `request` on the ledger open as `file` (validated as `header`, named `path`).
    fn call(&mut self, file: &File, header: &Header, path: &Path, request: &Request) -> Result<Reply, AccessError> {
        if let Some(waiting) = self.backoff.waiting() {
            return Err(waiting);
        }
        let result = self.exchange(file, header, path, request);
        self.used_at = Instant::now();
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

    fn exchange(&mut self, file: &File, header: &Header, path: &Path, request: &Request) -> Result<Reply, AccessError> {
        if self.running.is_none() {
            self.running = Some(self.start(file, header, path)?);
        }
        let running = self.running.as_mut().ok_or_else(|| AccessError::Worker("not running".into()))?;
        let line = serde_json::to_string(request).map_err(|error| AccessError::Worker(error.to_string()))?;
        let answer = write_line(&mut running.socket, &line)
            .and_then(|()| read_line(&mut running.reader, DEADLINE))
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

/// Starts a worker with `launcher` and sends it `hello` with the descriptor `fd`; the worker
/// and its first answer.
fn launch(launcher: &Launcher, hello: &Hello, fd: &File) -> Result<(Running, Reply), AccessError> {
    let fail = |what: &str, error: io::Error| AccessError::Worker(format!("cannot start it: {what}: {error}"));
    let (ours, theirs) = UnixStream::pair().map_err(|e| fail("socketpair", e))?;
    let child = match launcher {
        Launcher::Exec(program) => Some(spawn(program, theirs).map_err(|e| fail("spawn", e))?),
        #[cfg(test)]
        Launcher::Thread => {
            std::thread::spawn(move || serve(theirs, false));
            None
        }
    };
    let reader = BufReader::new(ours.try_clone().map_err(|e| fail("socket", e))?);
    let mut running = Running { child, socket: ours, reader };
    let line = serde_json::to_string(hello).map_err(|e| AccessError::Worker(e.to_string()))?;
    let answer = match send_with_fd(&running.socket, &line, fd).and_then(|()| read_line(&mut running.reader, DEADLINE * 4)) {
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

fn spawn(program: &Path, socket: UnixStream) -> io::Result<Child> {
    Command::new(program)
        .arg("ledger-worker")
        .env_clear()
        .stdin(Stdio::from(OwnedFd::from(socket)))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
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
        (Some(_), _, Some(code)) => format!("it exited with status {code} ({error})"),
        _ if timed_out => format!("no answer within {}ms (killed)", DEADLINE.as_millis()),
        _ => format!("it stopped answering ({error}; killed)"),
    }
}

fn signal_name(signal: i32) -> &'static str {
    match signal {
        libc::SIGBUS => "SIGBUS: the file was cut under its mapping",
        libc::SIGSEGV => "SIGSEGV: damaged bookkeeping",
        libc::SIGSYS => "SIGSYS: a forbidden system call",
        libc::SIGABRT => "SIGABRT",
        _ => "a signal",
    }
}

fn write_line(socket: &mut UnixStream, line: &str) -> io::Result<()> {
    socket.write_all(format!("{line}\n").as_bytes())
}

/// One line (without its newline), waiting at most `wait`; a line longer than [`MAX_LINE`]
/// or an end of file is an error.
fn read_line(reader: &mut BufReader<UnixStream>, wait: Duration) -> io::Result<String> {
    reader.get_ref().set_read_timeout(Some(wait))?;
    let mut line = String::new();
    let read = reader.by_ref().take(MAX_LINE).read_line(&mut line)?;
    if read == 0 {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the worker closed its socket"));
    }
    if !line.ends_with('\n') {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "a line too long"));
    }
    line.pop();
    Ok(line)
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
        serde_json::to_string(reply).map_err(io::Error::other).and_then(|line| write_line(socket, &line))
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
