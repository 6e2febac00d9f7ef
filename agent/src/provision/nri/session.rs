//! One connection to the runtime, from connect to disconnect: registration, the runtime's
//! calls on the plugin connection, and the answers, each within its deadline.
//!
//! Two tasks own the socket's halves (one reads frames and cuts them into messages, one writes
//! frames), so the session's loop only waits on channels and nothing it waits on loses bytes
//! when another event wins. Each call from the runtime that reaches the handler runs as a task
//! of its own, answered when the handler returns or at the deadline, whichever comes first.
use std::sync::Arc;
use std::time::Duration;

use prost::Message as _;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::proto::{self, code, event};
use super::wire::{self, FrameHeader, Message, Reassembler, WireError};
use super::{Adjustment, Config, Container, Handler, Pod};

/// How long registration, Configure and the first Synchronize may take from connecting; past
/// it the runtime has given up on the plugin too (its registration timeout is 5 s), and the
/// plugin dials again.
const REGISTRATION_TIMEOUT: Duration = Duration::from_secs(10);
/// The stream id of the plugin's one call, RegisterPlugin (a client's streams are odd).
const REGISTER_STREAM: u32 = 1;

/// The events the plugin subscribes to.
pub(super) const EVENTS: i32 = event::bit(event::CREATE_CONTAINER)
    | event::bit(event::START_CONTAINER)
    | event::bit(event::REMOVE_CONTAINER)
    | event::bit(event::REMOVE_POD_SANDBOX);

#[derive(Debug, thiserror::Error)]
pub(super) enum SessionError {
    #[error("connecting: {0}")]
    Connect(#[source] std::io::Error),
    #[error("the runtime closed the connection")]
    Closed,
    #[error("reading from the runtime: {0}")]
    Read(#[source] std::io::Error),
    #[error("writing to the runtime: {0}")]
    Write(#[source] std::io::Error),
    #[error("malformed input from the runtime: {0}")]
    Wire(#[from] WireError),
    #[error("malformed {what} from the runtime: {source}")]
    Decode {
        what: &'static str,
        source: prost::DecodeError,
    },
    #[error("protocol violation by the runtime: {0}")]
    Protocol(String),
    #[error("the runtime refused the registration: {0}")]
    Refused(String),
    #[error("registration and the first Synchronize did not complete within {0:?}")]
    RegistrationTimeout(Duration),
}

/// How a session ended.
pub(super) struct Outcome {
    /// The session got as far as answering Synchronize.
    pub synced: bool,
    pub error: SessionError,
}

/// What a finished call tells the session.
enum Done {
    Answered,
    Synced,
}

type Incoming = Result<(u32, Message), SessionError>;

/// Connects to the runtime, registers and serves until the connection ends; `connected` is set
/// once Synchronize is answered (the caller clears it).
pub(super) async fn serve<H: Handler>(
    config: &Config,
    handler: &Arc<H>,
    connected: &watch::Sender<bool>,
) -> Outcome {
    let mut session = Session {
        config,
        handler,
        synced: false,
        registered: false,
        pods: vec![],
        containers: vec![],
    };
    let error = match UnixStream::connect(&config.socket).await {
        Ok(stream) => session.run(stream, connected).await,
        Err(error) => SessionError::Connect(error),
    };
    Outcome {
        synced: session.synced,
        error,
    }
}

struct Session<'a, H> {
    config: &'a Config,
    handler: &'a Arc<H>,
    registered: bool,
    synced: bool,
    /// A split Synchronize's parts so far.
    pods: Vec<Pod>,
    containers: Vec<Container>,
}

impl<H: Handler> Session<'_, H> {
    async fn run(&mut self, stream: UnixStream, connected: &watch::Sender<bool>) -> SessionError {
        let (read, write) = stream.into_split();
        let (in_tx, mut in_rx) = mpsc::channel::<Incoming>(16);
        let (out_tx, out_rx) = mpsc::channel::<Vec<u8>>(16);
        // Dropped with the session: both halves' tasks and every call in flight end with it.
        let mut io = JoinSet::new();
        io.spawn(read_messages(read, in_tx.clone()));
        io.spawn(write_frames(write, out_rx, in_tx));
        let mut calls: JoinSet<Done> = JoinSet::new();

        let register = proto::RegisterPluginRequest {
            plugin_name: self.config.name.clone(),
            plugin_idx: self.config.index.clone(),
        };
        let timeout_nano = i64::try_from(REGISTRATION_TIMEOUT.as_nanos()).unwrap_or(i64::MAX);
        let request = proto::Request {
            service: proto::RUNTIME_SERVICE.into(),
            method: "RegisterPlugin".into(),
            payload: register.encode_to_vec(),
            timeout_nano,
        };
        let message = wire::encode_message(
            REGISTER_STREAM,
            wire::TYPE_REQUEST,
            0,
            &request.encode_to_vec(),
        );
        if out_tx
            .send(wire::encode_frames(wire::RUNTIME_CONN, &message))
            .await
            .is_err()
        {
            return SessionError::Closed;
        }
        let registration_deadline = Instant::now() + REGISTRATION_TIMEOUT;

        loop {
            tokio::select! {
                incoming = in_rx.recv() => {
                    let (conn, message) = match incoming {
                        Some(Ok(incoming)) => incoming,
                        Some(Err(error)) => return error,
                        None => return SessionError::Closed,
                    };
                    let handled = if conn == wire::RUNTIME_CONN {
                        self.on_response(message)
                    } else {
                        self.on_request(message, &out_tx, &mut calls).await
                    };
                    if let Err(error) = handled {
                        return error;
                    }
                }
                Some(done) = calls.join_next() => match done {
                    Ok(Done::Synced) => {
                        self.synced = true;
                        super::set_connected(connected, true);
                        info!(socket = %self.config.socket.display(), "NRI: registered and synchronized");
                    }
                    Ok(Done::Answered) => {}
                    Err(error) => warn!("NRI: a call's task failed: {error}"),
                },
                () = tokio::time::sleep_until(registration_deadline), if !self.synced => {
                    return SessionError::RegistrationTimeout(REGISTRATION_TIMEOUT);
                }
            }
        }
    }

    /// The runtime's answer on the runtime connection: only RegisterPlugin's is expected.
    fn on_response(&mut self, message: Message) -> Result<(), SessionError> {
        if message.kind != wire::TYPE_RESPONSE
            || message.stream != REGISTER_STREAM
            || self.registered
        {
            return Err(SessionError::Protocol(format!(
                "unexpected message (type {}, stream {}) on the runtime connection",
                message.kind, message.stream
            )));
        }
        let response = decode::<proto::Response>(&message.payload, "RegisterPlugin response")?;
        match response.status {
            Some(status) if status.code != code::OK => Err(SessionError::Refused(format!(
                "code {}: {}",
                status.code, status.message
            ))),
            _ => {
                self.registered = true;
                debug!("NRI: RegisterPlugin accepted");
                Ok(())
            }
        }
    }

    /// A call from the runtime on the plugin connection.
    async fn on_request(
        &mut self,
        message: Message,
        out: &mpsc::Sender<Vec<u8>>,
        calls: &mut JoinSet<Done>,
    ) -> Result<(), SessionError> {
        if message.kind != wire::TYPE_REQUEST {
            return Err(SessionError::Protocol(format!(
                "a message of type {} on the plugin connection (only requests are served)",
                message.kind
            )));
        }
        if message.stream.is_multiple_of(2) {
            return Err(SessionError::Protocol(format!(
                "request on stream {}, not odd",
                message.stream
            )));
        }
        let stream = message.stream;
        let request = decode::<proto::Request>(&message.payload, "ttRPC request")?;
        let deadline = self.deadline(request.timeout_nano);
        let reply = Reply {
            out: out.clone(),
            stream,
        };
        if request.service != proto::PLUGIN_SERVICE {
            reply.send(Err(unimplemented(&request))).await;
            return Ok(());
        }
        let payload = &request.payload;
        match request.method.as_str() {
            "Configure" => {
                let configure = decode::<proto::ConfigureRequest>(payload, "ConfigureRequest")?;
                info!(
                    runtime = %configure.runtime_name,
                    version = %configure.runtime_version,
                    request_timeout_ms = configure.request_timeout,
                    "NRI: configured by the runtime"
                );
                reply
                    .send(Ok(
                        proto::ConfigureResponse { events: EVENTS }.encode_to_vec()
                    ))
                    .await;
            }
            "Synchronize" => {
                let sync = decode::<proto::SynchronizeRequest>(payload, "SynchronizeRequest")?;
                self.pods.extend(sync.pods.into_iter().map(Pod::from));
                self.containers
                    .extend(sync.containers.into_iter().map(Container::from));
                if sync.more {
                    reply
                        .send(Ok(proto::SynchronizeResponse { more: true }.encode_to_vec()))
                        .await;
                } else {
                    let (pods, containers) = (
                        std::mem::take(&mut self.pods),
                        std::mem::take(&mut self.containers),
                    );
                    let handler = Arc::clone(self.handler);
                    let work =
                        tokio::spawn(async move { handler.synchronize(pods, containers).await });
                    let answer = proto::SynchronizeResponse { more: false }.encode_to_vec();
                    calls.spawn(answer_event(
                        "Synchronize",
                        work,
                        deadline,
                        reply,
                        answer,
                        Done::Synced,
                    ));
                }
            }
            "CreateContainer" => {
                let create = decode::<proto::ContainerRequest>(payload, "CreateContainerRequest")?;
                let Some((pod, container)) = pod_and_container(create) else {
                    reply.invalid("CreateContainer without a container").await;
                    return Ok(());
                };
                let handler = Arc::clone(self.handler);
                calls.spawn(async move {
                    let kept = container.clone();
                    let (answer, adjusted) =
                        create_container(Arc::clone(&handler), pod, container, deadline).await;
                    // An adjustment the runtime did not get (an error sent instead) is abandoned.
                    let sent = reply.send(answer).await;
                    if adjusted == Some(false) || (adjusted == Some(true) && !sent) {
                        handler.abandon_container(kept).await;
                    }
                    Done::Answered
                });
            }
            "RemoveContainer" => {
                let remove = decode::<proto::ContainerRequest>(payload, "RemoveContainerRequest")?;
                self.remove_container(remove, reply, deadline, calls).await;
            }
            "StartContainer" => {
                let start = decode::<proto::ContainerRequest>(payload, "StartContainerRequest")?;
                self.start_container(start, reply, deadline, calls).await;
            }
            "RemovePodSandbox" => {
                let remove = decode::<proto::PodRequest>(payload, "RemovePodSandboxRequest")?;
                self.remove_pod(remove.pod, reply, deadline, calls).await;
            }
            "StateChange" => {
                let change = decode::<proto::StateChangeEvent>(payload, "StateChangeEvent")?;
                match change.event {
                    event::REMOVE_CONTAINER => {
                        let remove = proto::ContainerRequest {
                            pod: change.pod,
                            container: change.container,
                        };
                        self.remove_container(remove, reply, deadline, calls).await;
                    }
                    event::REMOVE_POD_SANDBOX => {
                        self.remove_pod(change.pod, reply, deadline, calls).await
                    }
                    event::START_CONTAINER => {
                        let start = proto::ContainerRequest {
                            pod: change.pod,
                            container: change.container,
                        };
                        self.start_container(start, reply, deadline, calls).await;
                    }
                    _ => {
                        reply.send(Ok(proto::Empty {}.encode_to_vec())).await;
                    }
                }
            }
            "Shutdown" => {
                info!("NRI: the runtime is shutting down");
                reply.send(Ok(proto::Empty {}.encode_to_vec())).await;
            }
            _ => {
                reply.send(Err(unimplemented(&request))).await;
            }
        }
        Ok(())
    }

    async fn remove_container(
        &self,
        remove: proto::ContainerRequest,
        reply: Reply,
        deadline: Duration,
        calls: &mut JoinSet<Done>,
    ) {
        let Some((pod, container)) = pod_and_container(remove) else {
            return reply.invalid("RemoveContainer without a container").await;
        };
        let handler = Arc::clone(self.handler);
        let work = tokio::spawn(async move { handler.remove_container(pod, container).await });
        let answer = proto::Empty {}.encode_to_vec();
        calls.spawn(answer_event(
            "RemoveContainer",
            work,
            deadline,
            reply,
            answer,
            Done::Answered,
        ));
    }

    /// StartContainer: answered (always with success: the start is never failed) once the
    /// handler is done or at the deadline.
    async fn start_container(
        &self,
        start: proto::ContainerRequest,
        reply: Reply,
        deadline: Duration,
        calls: &mut JoinSet<Done>,
    ) {
        let Some((pod, container)) = pod_and_container(start) else {
            reply.send(Ok(proto::Empty {}.encode_to_vec())).await;
            return;
        };
        let handler = Arc::clone(self.handler);
        let work = tokio::spawn(async move { handler.start_container(pod, container, deadline).await });
        let answer = proto::Empty {}.encode_to_vec();
        calls.spawn(answer_event(
            "StartContainer",
            work,
            deadline,
            reply,
            answer,
            Done::Answered,
        ));
    }

    async fn remove_pod(
        &self,
        pod: Option<proto::PodSandbox>,
        reply: Reply,
        deadline: Duration,
        calls: &mut JoinSet<Done>,
    ) {
        let Some(pod) = pod.map(Pod::from) else {
            return reply.invalid("RemovePodSandbox without a pod").await;
        };
        let handler = Arc::clone(self.handler);
        let work = tokio::spawn(async move { handler.remove_pod(pod).await });
        let answer = proto::Empty {}.encode_to_vec();
        calls.spawn(answer_event(
            "RemovePodSandbox",
            work,
            deadline,
            reply,
            answer,
            Done::Answered,
        ));
    }

    /// The configured deadline, shortened to 3/4 of the runtime's own where that is sooner.
    fn deadline(&self, timeout_nano: i64) -> Duration {
        match u64::try_from(timeout_nano) {
            Ok(nanos) if nanos > 0 => self
                .config
                .handler_deadline
                .min(Duration::from_nanos(nanos / 4 * 3)),
            _ => self.config.handler_deadline,
        }
    }
}

/// Runs the handler's CreateContainer within `deadline`; past it, or if the handler panics,
/// the answer is an error (the runtime then fails the container's creation) and the handler's
/// work is cancelled and waited for. With the answer: `None` when the handler refused the
/// container (it made nothing), `Some(true)` when the answer is its adjustment, `Some(false)`
/// when the runtime is told an error instead (what the handler made is to be abandoned).
async fn create_container<H: Handler>(
    handler: Arc<H>,
    pod: Pod,
    container: Container,
    deadline: Duration,
) -> (Result<Vec<u8>, proto::Status>, Option<bool>) {
    let id = container.id.clone();
    let mut work = AbortOnDrop(tokio::spawn(async move {
        handler.create_container(pod, container).await
    }));
    let adjustment = match tokio::time::timeout(deadline, &mut work.0).await {
        Ok(Ok(Ok(adjustment))) => adjustment,
        Ok(Ok(Err(message))) => {
            info!(container = %id, "NRI: container refused: {message}");
            return (Err(status(code::UNKNOWN, message)), None);
        }
        Ok(Err(join)) => {
            warn!(container = %id, "NRI: the CreateContainer handler failed: {join}");
            let answer = status(
                code::UNKNOWN,
                format!("vramguard: the CreateContainer handler failed: {join}"),
            );
            return (Err(answer), Some(false));
        }
        Err(_elapsed) => {
            warn!(container = %id, "NRI: CreateContainer not handled within {deadline:?}; refused");
            // Stopped before the answer goes: whatever it did by now is what is abandoned.
            work.0.abort();
            let _ = (&mut work.0).await;
            let answer = status(
                code::DEADLINE_EXCEEDED,
                format!("vramguard: container {id} not provisioned within {deadline:?}"),
            );
            return (Err(answer), Some(false));
        }
    };
    match adjustment.encode() {
        Ok(adjust) => (
            Ok(proto::CreateContainerResponse {
                adjust: Some(adjust),
            }
            .encode_to_vec()),
            Some(true),
        ),
        Err(problem) => {
            warn!(container = %id, "NRI: the handler's adjustment is invalid: {problem}");
            let answer = status(
                code::UNKNOWN,
                format!("vramguard: invalid adjustment for container {id}: {problem}"),
            );
            (Err(answer), Some(false))
        }
    }
}

/// Waits for an event's handler up to `deadline` (past it the handler goes on by itself),
/// then answers the runtime with `answer`.
async fn answer_event(
    what: &'static str,
    work: tokio::task::JoinHandle<()>,
    deadline: Duration,
    reply: Reply,
    answer: Vec<u8>,
    done: Done,
) -> Done {
    match tokio::time::timeout(deadline, work).await {
        Ok(Ok(())) => {}
        Ok(Err(join)) => warn!("NRI: the {what} handler failed: {join}"),
        Err(_elapsed) => {
            warn!("NRI: {what} not handled within {deadline:?}; answered, the handler goes on")
        }
    }
    reply.send(Ok(answer)).await;
    done
}

/// A task aborted when this is dropped (a session ending cancels the CreateContainer work
/// nobody can be answered about any more).
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Where a call's answer goes.
struct Reply {
    out: mpsc::Sender<Vec<u8>>,
    stream: u32,
}

impl Reply {
    async fn invalid(&self, problem: &str) {
        self.send(Err(status(code::INVALID_ARGUMENT, problem.into())))
            .await;
    }

    /// Sends `answer`; false if an error went instead (an answer over ttRPC's limit).
    async fn send(&self, answer: Result<Vec<u8>, proto::Status>) -> bool {
        let response = |status, payload| proto::Response {
            status: Some(status),
            payload,
        };
        let mut as_given = true;
        let mut encoded = match answer {
            Ok(payload) => response(status(code::OK, String::new()), payload),
            Err(status) => response(status, vec![]),
        }
        .encode_to_vec();
        if encoded.len() > wire::MAX_OUTGOING_PAYLOAD {
            let problem = format!(
                "vramguard: an answer of {} bytes, over ttRPC's limit",
                encoded.len()
            );
            warn!("NRI: {problem}; an error sent instead");
            encoded = response(status(code::RESOURCE_EXHAUSTED, problem), vec![]).encode_to_vec();
            as_given = false;
        }
        let message = wire::encode_message(self.stream, wire::TYPE_RESPONSE, 0, &encoded);
        // A closed channel: the session is ending and nobody is waiting for this answer.
        let _ = self
            .out
            .send(wire::encode_frames(wire::PLUGIN_CONN, &message))
            .await;
        as_given
    }
}

fn status(code: i32, message: String) -> proto::Status {
    proto::Status { code, message }
}

fn unimplemented(request: &proto::Request) -> proto::Status {
    status(
        code::UNIMPLEMENTED,
        format!("{}/{} is not implemented", request.service, request.method),
    )
}

fn pod_and_container(request: proto::ContainerRequest) -> Option<(Pod, Container)> {
    let container = Container::from(request.container?);
    // The runtime always sends the pod; without it, the container's pod id is all there is.
    let pod = request.pod.map(Pod::from).unwrap_or_else(|| Pod {
        id: container.pod_id.clone(),
        ..Pod::default()
    });
    Some((pod, container))
}

fn decode<M: prost::Message + Default>(
    bytes: &[u8],
    what: &'static str,
) -> Result<M, SessionError> {
    M::decode(bytes).map_err(|source| SessionError::Decode { what, source })
}

/// Reads frames, cuts each mux connection's stream into messages and hands them over; ends
/// with the reason the connection can no longer be read.
async fn read_messages(read: OwnedReadHalf, messages: mpsc::Sender<Incoming>) {
    let mut read = BufReader::new(read);
    let mut plugin = Reassembler::default();
    let mut runtime = Reassembler::default();
    let error = loop {
        let mut header = [0; wire::FRAME_HEADER_LEN];
        match read.read_exact(&mut header).await {
            Ok(_) => {}
            Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => {
                break SessionError::Closed
            }
            Err(error) => break SessionError::Read(error),
        }
        let header = match FrameHeader::decode(header) {
            Ok(header) => header,
            Err(error) => break error.into(),
        };
        let mut payload = vec![0; header.len as usize];
        if let Err(error) = read.read_exact(&mut payload).await {
            break SessionError::Read(error);
        }
        let reassembler = match header.conn {
            wire::PLUGIN_CONN => &mut plugin,
            wire::RUNTIME_CONN => &mut runtime,
            other => {
                debug!(
                    "NRI: ignoring {} bytes for mux connection {other}",
                    header.len
                );
                continue;
            }
        };
        reassembler.push(&payload);
        let error = loop {
            match reassembler.next_message() {
                Ok(Some(message)) => {
                    if messages.send(Ok((header.conn, message))).await.is_err() {
                        return;
                    }
                }
                Ok(None) => break None,
                Err(error) => break Some(error),
            }
        };
        if let Some(error) = error {
            break error.into();
        }
    };
    let _ = messages.send(Err(error)).await;
}

/// Writes framed bytes in order; a failure ends the session.
async fn write_frames(
    mut write: OwnedWriteHalf,
    mut frames: mpsc::Receiver<Vec<u8>>,
    errors: mpsc::Sender<Incoming>,
) {
    while let Some(bytes) = frames.recv().await {
        if let Err(error) = write.write_all(&bytes).await {
            let _ = errors.send(Err(SessionError::Write(error))).await;
            return;
        }
    }
}

impl Adjustment {
    /// The adjustment as NRI's message, checked: absolute paths, environment keys that are
    /// names (NRI reads a leading `-` as "remove").
    fn encode(&self) -> Result<proto::ContainerAdjustment, String> {
        let mut adjust = proto::ContainerAdjustment::default();
        for mount in &self.mounts {
            let source = mount
                .source
                .to_str()
                .ok_or_else(|| format!("mount source {:?} is not UTF-8", mount.source))?;
            if !source.starts_with('/') || !mount.destination.starts_with('/') {
                return Err(format!(
                    "mount {source} -> {} is not between absolute paths",
                    mount.destination
                ));
            }
            if source.contains('\0') || mount.destination.contains('\0') {
                return Err(format!(
                    "mount {source:?} -> {:?} holds a NUL",
                    mount.destination
                ));
            }
            let access = if mount.read_only { "ro" } else { "rw" };
            adjust.mounts.push(proto::Mount {
                destination: mount.destination.clone(),
                r#type: "bind".into(),
                source: source.into(),
                options: vec!["rbind".into(), "rprivate".into(), access.into()],
            });
        }
        for (key, value) in &self.env {
            if key.is_empty()
                || key.starts_with('-')
                || key.contains(['=', '\0'])
                || value.contains('\0')
            {
                return Err(format!(
                    "environment variable {key:?} is not a valid name=value"
                ));
            }
            adjust.env.push(proto::KeyValue {
                key: key.clone(),
                value: value.clone(),
            });
        }
        Ok(adjust)
    }
}
