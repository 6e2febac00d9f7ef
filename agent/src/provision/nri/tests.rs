//! The plugin against a fake runtime on a real unix socket. The fake runtime reads and writes
//! the wire with its own small code (frames, ttRPC headers, protobuf fields by number), so the
//! tests check the bytes NRI's runtime would see, not a round trip through the plugin's code.
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, watch};

use super::{run, Adjustment, Config, Container, Handler, Mount, Pod};

/// Protobuf by field number, written for these tests.
mod pb {
    #[derive(Debug, Clone, PartialEq)]
    pub enum Value {
        Varint(u64),
        Bytes(Vec<u8>),
    }

    pub type Fields = Vec<(u32, Value)>;

    fn varint(bytes: &mut &[u8]) -> u64 {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let (&byte, rest) = bytes.split_first().expect("varint cut short");
            *bytes = rest;
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return value;
            }
        }
        panic!("varint too long")
    }

    pub fn decode(mut bytes: &[u8]) -> Fields {
        let mut fields = Vec::new();
        while !bytes.is_empty() {
            let key = varint(&mut bytes);
            let value = match key & 7 {
                0 => Value::Varint(varint(&mut bytes)),
                2 => {
                    let len = usize::try_from(varint(&mut bytes)).expect("length");
                    let (value, rest) = bytes.split_at(len);
                    bytes = rest;
                    Value::Bytes(value.to_vec())
                }
                other => panic!("wire type {other} not expected here"),
            };
            fields.push((u32::try_from(key >> 3).expect("field number"), value));
        }
        fields
    }

    pub fn all_bytes(fields: &Fields, number: u32) -> Vec<Vec<u8>> {
        fields
            .iter()
            .filter(|(n, _)| *n == number)
            .map(|(_, value)| match value {
                Value::Bytes(bytes) => bytes.clone(),
                Value::Varint(_) => panic!("field {number} is a varint"),
            })
            .collect()
    }

    pub fn strings(fields: &Fields, number: u32) -> Vec<String> {
        all_bytes(fields, number)
            .into_iter()
            .map(|b| String::from_utf8(b).expect("UTF-8"))
            .collect()
    }

    /// A singular string field (proto3: absent means empty).
    pub fn string(fields: &Fields, number: u32) -> String {
        strings(fields, number).pop().unwrap_or_default()
    }

    pub fn message(fields: &Fields, number: u32) -> Option<Fields> {
        all_bytes(fields, number).pop().map(|b| decode(&b))
    }

    pub fn uint(fields: &Fields, number: u32) -> u64 {
        let mut found = 0;
        for (n, value) in fields {
            if *n == number {
                match value {
                    Value::Varint(v) => found = *v,
                    Value::Bytes(_) => panic!("field {number} is length-delimited"),
                }
            }
        }
        found
    }

    #[derive(Default)]
    pub struct Writer(pub Vec<u8>);

    impl Writer {
        fn put_varint(&mut self, mut value: u64) {
            while value >= 0x80 {
                self.0.push((value as u8) | 0x80);
                value >>= 7;
            }
            self.0.push(value as u8);
        }

        pub fn uint(mut self, number: u32, value: u64) -> Self {
            self.put_varint(u64::from(number) << 3);
            self.put_varint(value);
            self
        }

        pub fn bytes(mut self, number: u32, value: &[u8]) -> Self {
            self.put_varint((u64::from(number) << 3) | 2);
            self.put_varint(value.len() as u64);
            self.0.extend_from_slice(value);
            self
        }

        pub fn str(self, number: u32, value: &str) -> Self {
            self.bytes(number, value.as_bytes())
        }

        /// A `map<string, string>` entry.
        pub fn entry(self, number: u32, key: &str, value: &str) -> Self {
            let entry = Writer::default().str(1, key).str(2, value);
            self.bytes(number, &entry.0)
        }
    }
}

use pb::Writer;

/// NRI's Event numbers, from api.proto.
const REMOVE_POD_SANDBOX: u64 = 3;
const CREATE_CONTAINER: u64 = 4;
const START_CONTAINER: u64 = 6;
const REMOVE_CONTAINER: u64 = 11;

/// A runtime's side of one plugin connection.
struct Peer {
    stream: UnixStream,
    /// Per mux connection (index 1 and 2): bytes received, not yet a whole message.
    pending: [Vec<u8>; 3],
    next_stream: u32,
}

/// A ttRPC message as the fake runtime reads it.
#[derive(Debug)]
struct Msg {
    conn: u32,
    stream: u32,
    kind: u8,
    payload: Vec<u8>,
}

/// A call's answer: the status code and message, and the payload's fields.
#[derive(Debug)]
struct Answer {
    code: u64,
    message: String,
    payload: pb::Fields,
}

async fn within<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), future)
        .await
        .unwrap_or_else(|_| panic!("{what}: nothing after 30 s"))
}

impl Peer {
    async fn accept(listener: &UnixListener) -> Self {
        let (stream, _) = within("accepting the plugin", listener.accept())
            .await
            .expect("accept");
        Self {
            stream,
            pending: Default::default(),
            next_stream: 1,
        }
    }

    /// The next frame, or None at end of stream.
    async fn frame(&mut self) -> Option<(u32, Vec<u8>)> {
        let mut header = [0u8; 8];
        match within("reading a frame", self.stream.read_exact(&mut header)).await {
            Ok(_) => {}
            Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => return None,
            Err(error) => panic!("reading a frame: {error}"),
        }
        let conn = u32::from_be_bytes(header[..4].try_into().expect("4 bytes"));
        let len = u32::from_be_bytes(header[4..].try_into().expect("4 bytes"));
        let mut payload = vec![0; len as usize];
        within("reading a frame", self.stream.read_exact(&mut payload))
            .await
            .expect("frame payload");
        Some((conn, payload))
    }

    async fn message(&mut self) -> Msg {
        loop {
            for conn in [1u32, 2] {
                let buf = &mut self.pending[conn as usize];
                if buf.len() >= 10 {
                    let len = u32::from_be_bytes(buf[..4].try_into().expect("4 bytes")) as usize;
                    if buf.len() >= 10 + len {
                        let stream = u32::from_be_bytes(buf[4..8].try_into().expect("4 bytes"));
                        let kind = buf[8];
                        let payload = buf[10..10 + len].to_vec();
                        buf.drain(..10 + len);
                        return Msg {
                            conn,
                            stream,
                            kind,
                            payload,
                        };
                    }
                }
            }
            let (conn, payload) = self
                .frame()
                .await
                .expect("the plugin closed the connection");
            assert!(conn == 1 || conn == 2, "a frame for mux connection {conn}");
            self.pending[conn as usize].extend_from_slice(&payload);
        }
    }

    async fn send_frame(&mut self, conn: u32, payload: &[u8]) {
        let mut frame = conn.to_be_bytes().to_vec();
        frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        frame.extend_from_slice(payload);
        self.stream
            .write_all(&frame)
            .await
            .expect("writing a frame");
    }

    async fn send_message(&mut self, conn: u32, stream: u32, kind: u8, payload: &[u8]) {
        let mut message = (payload.len() as u32).to_be_bytes().to_vec();
        message.extend_from_slice(&stream.to_be_bytes());
        message.extend_from_slice(&[kind, 0]);
        message.extend_from_slice(payload);
        self.send_frame(conn, &message).await;
    }

    /// Reads the plugin's RegisterPlugin call, accepts it, and returns (name, index).
    async fn expect_register(&mut self) -> (String, String) {
        let msg = self.message().await;
        assert_eq!(
            (msg.conn, msg.kind),
            (2, 1),
            "RegisterPlugin: a request on the runtime connection"
        );
        assert_eq!(msg.stream % 2, 1, "a client's stream ids are odd");
        let request = pb::decode(&msg.payload);
        assert_eq!(pb::string(&request, 1), "nri.pkg.api.v1alpha1.Runtime");
        assert_eq!(pb::string(&request, 2), "RegisterPlugin");
        let register = pb::decode(&pb::all_bytes(&request, 3).pop().unwrap_or_default());
        // Response{status: Status{}} with an empty Empty: accepted.
        let response = Writer::default().bytes(1, &[]);
        self.send_message(2, msg.stream, 2, &response.0).await;
        (pb::string(&register, 1), pb::string(&register, 2))
    }

    /// Calls `method` of NRI's Plugin service and reads the answer.
    async fn call(&mut self, method: &str, payload: &[u8], timeout: Option<Duration>) -> Answer {
        let stream = self.next_stream;
        self.next_stream += 2;
        let mut request = Writer::default()
            .str(1, "nri.pkg.api.v1alpha1.Plugin")
            .str(2, method)
            .bytes(3, payload);
        if let Some(timeout) = timeout {
            request = request.uint(4, timeout.as_nanos() as u64);
        }
        self.send_message(1, stream, 1, &request.0).await;
        let msg = self.message().await;
        assert_eq!(
            (msg.conn, msg.stream, msg.kind),
            (1, stream, 2),
            "{method}: the response on its stream"
        );
        let response = pb::decode(&msg.payload);
        let status = pb::message(&response, 1).unwrap_or_default();
        Answer {
            code: pb::uint(&status, 1),
            message: pb::string(&status, 2),
            payload: pb::decode(&pb::all_bytes(&response, 2).pop().unwrap_or_default()),
        }
    }

    /// RegisterPlugin, Configure, Synchronize with `sync`; returns the subscribed events.
    async fn handshake(&mut self, sync: &[u8]) -> u64 {
        let (name, index) = self.expect_register().await;
        assert_eq!((name.as_str(), index.as_str()), ("vramguard", "10"));
        let configure = Writer::default().str(2, "containerd").str(3, "1.7.24");
        let answer = self
            .call("Configure", &configure.0, Some(Duration::from_secs(2)))
            .await;
        assert_eq!(answer.code, 0, "Configure: {}", answer.message);
        let events = pb::uint(&answer.payload, 2);
        let answer = self
            .call("Synchronize", sync, Some(Duration::from_secs(2)))
            .await;
        assert_eq!(answer.code, 0, "Synchronize: {}", answer.message);
        events
    }

    /// True once the plugin has closed the connection (whatever it sent before is skipped).
    async fn closed(&mut self) -> bool {
        while self.frame().await.is_some() {}
        true
    }
}

/// What the test handler was called with.
#[derive(Debug, PartialEq)]
enum Seen {
    Sync(Vec<Pod>, Vec<Container>),
    Create(String),
    RemoveContainer(String, String),
    RemovePod(String),
    Start(String, String),
    /// A slow CreateContainer's future was dropped.
    Cancelled(String),
    /// The creation was abandoned (the runtime answered without the handler's adjustment).
    Abandoned(String),
}

struct Recorder {
    seen: mpsc::UnboundedSender<Seen>,
}

struct OnDrop(mpsc::UnboundedSender<Seen>, String);

impl Drop for OnDrop {
    fn drop(&mut self) {
        let _ = self.0.send(Seen::Cancelled(self.1.clone()));
    }
}

fn adjustment() -> Adjustment {
    Adjustment {
        mounts: vec![
            Mount {
                source: "/var/lib/vramguard/limits/c1".into(),
                destination: "/run/vramguard/limits".into(),
                read_only: true,
            },
            Mount {
                source: "/var/lib/vramguard/ledgers/c1".into(),
                destination: "/run/vramguard".into(),
                read_only: false,
            },
        ],
        env: vec![
            ("VRAMGUARD_LEDGER".into(), "/run/vramguard/ledger".into()),
            ("CUDA_DEVICE_MEMORY_LIMIT".into(), "1g".into()),
        ],
    }
}

impl Handler for Recorder {
    fn synchronize(
        &self,
        pods: Vec<Pod>,
        containers: Vec<Container>,
    ) -> impl std::future::Future<Output = ()> + Send {
        let seen = self.seen.clone();
        async move {
            let _ = seen.send(Seen::Sync(pods, containers));
        }
    }

    fn create_container(
        &self,
        _pod: Pod,
        container: Container,
    ) -> impl std::future::Future<Output = Result<Adjustment, String>> + Send {
        let seen = self.seen.clone();
        async move {
            let _ = seen.send(Seen::Create(container.id.clone()));
            match container.name.as_str() {
                "deny" => Err("no quota for this pod".into()),
                "slow" => {
                    let _guard = OnDrop(seen, container.id.clone());
                    std::future::pending::<()>().await;
                    Ok(Adjustment::default())
                }
                "huge" => Ok(Adjustment {
                    mounts: vec![],
                    env: vec![("BIG".into(), "x".repeat(5 << 20))],
                }),
                "bad-env" => Ok(Adjustment {
                    mounts: vec![],
                    env: vec![("A=B".into(), "x".into())],
                }),
                _ => Ok(adjustment()),
            }
        }
    }

    fn abandon_container(&self, container: Container) -> impl std::future::Future<Output = ()> + Send {
        let seen = self.seen.clone();
        async move {
            let _ = seen.send(Seen::Abandoned(container.id));
        }
    }

    fn remove_container(
        &self,
        pod: Pod,
        container: Container,
    ) -> impl std::future::Future<Output = ()> + Send {
        let seen = self.seen.clone();
        async move {
            let _ = seen.send(Seen::RemoveContainer(pod.id, container.id));
        }
    }

    fn remove_pod(&self, pod: Pod) -> impl std::future::Future<Output = ()> + Send {
        let seen = self.seen.clone();
        async move {
            let _ = seen.send(Seen::RemovePod(pod.id));
        }
    }

    fn start_container(&self, pod: Pod, container: Container, _budget: Duration) -> impl std::future::Future<Output = ()> + Send {
        let seen = self.seen.clone();
        async move {
            let _ = seen.send(Seen::Start(pod.id, container.id));
        }
    }
}

/// A socket in a directory of its own, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("vramguard-nri-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch directory");
        Self(dir)
    }

    fn socket(&self) -> PathBuf {
        self.0.join("nri.sock")
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

struct Plugin {
    seen: mpsc::UnboundedReceiver<Seen>,
    connected: watch::Receiver<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Plugin {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Plugin {
    fn start(socket: &Path, handler_deadline: Duration) -> Self {
        let (tx, seen) = mpsc::unbounded_channel();
        let (connected_tx, connected) = watch::channel(false);
        let config = Config {
            socket: socket.into(),
            name: "vramguard".into(),
            index: "10".into(),
            handler_deadline,
        };
        let task = tokio::spawn(run(config, Arc::new(Recorder { seen: tx }), connected_tx));
        Self {
            seen,
            connected,
            task,
        }
    }

    async fn next_seen(&mut self) -> Seen {
        within("the handler", self.seen.recv())
            .await
            .expect("the plugin is running")
    }

    async fn wait_connected(&mut self, up: bool) {
        within("the connected flag", self.connected.wait_for(|c| *c == up))
            .await
            .expect("the plugin is running");
    }
}

fn pod_bytes(id: &str) -> Vec<u8> {
    Writer::default()
        .str(1, id)
        .str(2, "web")
        .str(3, "uid-1")
        .str(4, "team-a")
        .entry(5, "app", "web")
        .entry(6, "vramguard.io/gpu-memory", "1Gi")
        .entry(6, "other", "x")
        .0
}

fn container_bytes(id: &str, pod_id: &str, name: &str) -> Vec<u8> {
    let device = |path: &str| Writer::default().str(1, path).str(2, "c").uint(3, 195).uint(4, 1).0;
    let linux = Writer::default()
        .bytes(2, &device("/dev/nvidia1"))
        .bytes(2, &device("/dev/nvidiactl"))
        .str(5, "kubepods-besteffort.slice:cri-containerd:c1");
    let cdi = Writer::default().str(1, "nvidia.com/gpu=1");
    let mount = |destination: &str, kind: &str, source: &str, options: &[&str]| {
        let mut mount = Writer::default().str(1, destination).str(2, kind).str(3, source);
        for option in options {
            mount = mount.str(4, option);
        }
        mount.0
    };
    Writer::default()
        .str(1, id)
        .str(2, pod_id)
        .str(3, name)
        .uint(4, 1)
        .entry(6, "io.kubernetes.container.name", name)
        .str(8, "PATH=/bin")
        .str(8, "CUDA_DEVICE_MEMORY_LIMIT=64g")
        .str(8, "NOEQUALS")
        .bytes(9, &mount("/proc", "proc", "proc", &["nosuid"]))
        .bytes(9, &mount("/run/vramguard/claim", "bind", "/var/lib/vramguard/dra/claims/u1", &["ro", "bind"]))
        .bytes(11, &linux.0)
        .uint(12, 4242)
        .bytes(20, &cdi.0)
        .0
}

fn expected_pod(id: &str) -> Pod {
    Pod {
        id: id.into(),
        name: "web".into(),
        namespace: "team-a".into(),
        uid: "uid-1".into(),
        annotations: [
            ("vramguard.io/gpu-memory".to_string(), "1Gi".to_string()),
            ("other".into(), "x".into()),
        ]
        .into_iter()
        .collect(),
        labels: [("app".to_string(), "web".to_string())]
            .into_iter()
            .collect(),
    }
}

fn expected_container(id: &str, pod_id: &str, name: &str) -> Container {
    Container {
        id: id.into(),
        pod_id: pod_id.into(),
        name: name.into(),
        env: vec![
            ("PATH".into(), "/bin".into()),
            ("CUDA_DEVICE_MEMORY_LIMIT".into(), "64g".into()),
        ],
        annotations: [("io.kubernetes.container.name".to_string(), name.to_string())]
            .into_iter()
            .collect(),
        mounts: vec![
            Mount { source: "proc".into(), destination: "/proc".into(), read_only: false },
            Mount {
                source: "/var/lib/vramguard/dra/claims/u1".into(),
                destination: "/run/vramguard/claim".into(),
                read_only: true,
            },
        ],
        cgroups_path: "kubepods-besteffort.slice:cri-containerd:c1".into(),
        devices: vec!["/dev/nvidia1".into(), "/dev/nvidiactl".into()],
        cdi_devices: vec!["nvidia.com/gpu=1".into()],
        pid: Some(4242),
    }
}

fn create_request(container_id: &str, name: &str) -> Vec<u8> {
    Writer::default()
        .bytes(1, &pod_bytes("p1"))
        .bytes(2, &container_bytes(container_id, "p1", name))
        .0
}

fn sync_one() -> Vec<u8> {
    Writer::default()
        .bytes(1, &pod_bytes("p1"))
        .bytes(2, &container_bytes("c0", "p1", "main"))
        .0
}

/// A fake runtime's socket and the plugin connected to it, synchronized.
async fn synchronized(tag: &str, deadline: Duration) -> (Scratch, UnixListener, Plugin, Peer) {
    let scratch = Scratch::new(tag);
    let listener = UnixListener::bind(scratch.socket()).expect("bind");
    let mut plugin = Plugin::start(&scratch.socket(), deadline);
    let peer = reconnected(&listener, &mut plugin).await;
    (scratch, listener, plugin, peer)
}

/// The plugin's next connection, through the handshake until it says it is connected.
async fn reconnected(listener: &UnixListener, plugin: &mut Plugin) -> Peer {
    let mut peer = Peer::accept(listener).await;
    peer.handshake(&sync_one()).await;
    assert!(matches!(plugin.next_seen().await, Seen::Sync(..)));
    plugin.wait_connected(true).await;
    peer
}

#[tokio::test]
async fn registers_subscribes_and_hands_synchronize_to_the_handler() {
    let scratch = Scratch::new("register");
    let listener = UnixListener::bind(scratch.socket()).expect("bind");
    let mut plugin = Plugin::start(&scratch.socket(), Duration::from_secs(5));
    let mut peer = Peer::accept(&listener).await;
    assert!(
        !*plugin.connected.borrow(),
        "not connected before Synchronize"
    );

    let events = peer.handshake(&sync_one()).await;
    // api.proto: bit (event - 1) for each event subscribed.
    let want = (1 << (CREATE_CONTAINER - 1))
        | (1 << (START_CONTAINER - 1))
        | (1 << (REMOVE_CONTAINER - 1))
        | (1 << (REMOVE_POD_SANDBOX - 1));
    assert_eq!(events, want, "events subscribed: {events:#b}");
    assert_eq!(
        plugin.next_seen().await,
        Seen::Sync(
            vec![expected_pod("p1")],
            vec![expected_container("c0", "p1", "main")]
        )
    );
    plugin.wait_connected(true).await;
}

#[tokio::test]
async fn create_container_answers_the_adjustment_as_nri_reads_it() {
    let (_scratch, _listener, mut plugin, mut peer) =
        synchronized("create", Duration::from_secs(5)).await;

    let answer = peer
        .call(
            "CreateContainer",
            &create_request("c1", "main"),
            Some(Duration::from_secs(2)),
        )
        .await;
    assert_eq!((answer.code, answer.message.as_str()), (0, ""));
    assert_eq!(plugin.next_seen().await, Seen::Create("c1".into()));
    // CreateContainerResponse.adjust (1): ContainerAdjustment{mounts (3), env (4)}.
    let adjust = pb::message(&answer.payload, 1).expect("an adjustment");
    let mounts: Vec<_> = pb::all_bytes(&adjust, 3)
        .iter()
        .map(|m| {
            let m = pb::decode(m);
            (
                pb::string(&m, 1),
                pb::string(&m, 2),
                pb::string(&m, 3),
                pb::strings(&m, 4),
            )
        })
        .collect();
    assert_eq!(
        mounts,
        [
            (
                "/run/vramguard/limits".to_string(),
                "bind".to_string(),
                "/var/lib/vramguard/limits/c1".to_string(),
                vec!["rbind".to_string(), "rprivate".into(), "ro".into()]
            ),
            (
                "/run/vramguard".to_string(),
                "bind".to_string(),
                "/var/lib/vramguard/ledgers/c1".to_string(),
                vec!["rbind".to_string(), "rprivate".into(), "rw".into()]
            ),
        ]
    );
    let env: Vec<_> = pb::all_bytes(&adjust, 4)
        .iter()
        .map(|kv| {
            let kv = pb::decode(kv);
            (pb::string(&kv, 1), pb::string(&kv, 2))
        })
        .collect();
    assert_eq!(
        env,
        [
            (
                "VRAMGUARD_LEDGER".to_string(),
                "/run/vramguard/ledger".to_string()
            ),
            ("CUDA_DEVICE_MEMORY_LIMIT".into(), "1g".into())
        ]
    );
    // Nothing but mounts and env: no hooks, devices, resources for the validator to refuse.
    assert!(adjust.iter().all(|(n, _)| *n == 3 || *n == 4), "{adjust:?}");
}

#[tokio::test]
async fn a_handler_error_is_a_ttrpc_error_and_the_connection_stays() {
    let (_scratch, _listener, mut plugin, mut peer) =
        synchronized("deny", Duration::from_secs(5)).await;

    let answer = peer
        .call("CreateContainer", &create_request("c2", "deny"), None)
        .await;
    assert_eq!(answer.code, 2, "gRPC Unknown");
    assert_eq!(answer.message, "no quota for this pod");
    assert!(answer.payload.is_empty());
    assert_eq!(plugin.next_seen().await, Seen::Create("c2".into()));

    // An adjustment the runtime would misread (NRI reads "-KEY" as removal; "A=B" is no name)
    // is refused, not sent.
    let answer = peer
        .call("CreateContainer", &create_request("c3", "bad-env"), None)
        .await;
    assert_eq!(answer.code, 2);
    assert!(
        answer.message.contains("invalid adjustment"),
        "{}",
        answer.message
    );
    assert_eq!(plugin.next_seen().await, Seen::Create("c3".into()));
    // Made for nothing: abandoned.
    assert_eq!(plugin.next_seen().await, Seen::Abandoned("c3".into()));

    // An answer over ttRPC's 4 MiB (which the runtime would drop) becomes an error.
    let answer = peer
        .call("CreateContainer", &create_request("c8", "huge"), None)
        .await;
    assert_eq!(answer.code, 8, "gRPC ResourceExhausted: {}", answer.message);
    assert_eq!(plugin.next_seen().await, Seen::Create("c8".into()));
    assert_eq!(plugin.next_seen().await, Seen::Abandoned("c8".into()));

    // Still connected: the next container gets its adjustment.
    let answer = peer
        .call("CreateContainer", &create_request("c4", "main"), None)
        .await;
    assert_eq!(answer.code, 0);
    assert!(pb::message(&answer.payload, 1).is_some());
    assert!(*plugin.connected.borrow());
}

#[tokio::test]
async fn a_slow_handler_is_answered_with_an_error_at_the_deadline_and_cancelled() {
    let (_scratch, _listener, mut plugin, mut peer) =
        synchronized("slow", Duration::from_millis(300)).await;

    let answer = peer
        .call(
            "CreateContainer",
            &create_request("c5", "slow"),
            Some(Duration::from_secs(2)),
        )
        .await;
    assert_eq!(answer.code, 4, "gRPC DeadlineExceeded: {}", answer.message);
    assert!(
        answer.message.contains("c5") && answer.message.contains("not provisioned"),
        "{}",
        answer.message
    );
    assert_eq!(plugin.next_seen().await, Seen::Create("c5".into()));
    assert_eq!(plugin.next_seen().await, Seen::Cancelled("c5".into()));
    // Cancelled first, then abandoned: what the call made can go.
    assert_eq!(plugin.next_seen().await, Seen::Abandoned("c5".into()));
    // The connection goes on.
    let answer = peer
        .call("CreateContainer", &create_request("c6", "main"), None)
        .await;
    assert_eq!(answer.code, 0);
}

#[tokio::test]
async fn the_runtimes_own_deadline_shortens_the_handlers() {
    // An hour: only the request's timeout (400 ms, so 300 ms) can end the slow call.
    let (_scratch, _listener, _plugin, mut peer) =
        synchronized("runtime-deadline", Duration::from_secs(3600)).await;

    let answer = peer
        .call(
            "CreateContainer",
            &create_request("c7", "slow"),
            Some(Duration::from_millis(400)),
        )
        .await;
    assert_eq!(answer.code, 4, "{}", answer.message);
    assert!(answer.message.contains("300ms"), "{}", answer.message);
}

#[tokio::test]
async fn removals_reach_the_handler_by_state_change_and_by_their_own_calls() {
    let (_scratch, _listener, mut plugin, mut peer) =
        synchronized("remove", Duration::from_secs(5)).await;

    // NRI 0.6: StateChangeEvent{event, pod, container}.
    let change = Writer::default()
        .uint(1, REMOVE_CONTAINER)
        .bytes(2, &pod_bytes("p1"))
        .bytes(3, &container_bytes("c1", "p1", "main"));
    assert_eq!(peer.call("StateChange", &change.0, None).await.code, 0);
    assert_eq!(
        plugin.next_seen().await,
        Seen::RemoveContainer("p1".into(), "c1".into())
    );
    let change = Writer::default()
        .uint(1, REMOVE_POD_SANDBOX)
        .bytes(2, &pod_bytes("p1"));
    assert_eq!(peer.call("StateChange", &change.0, None).await.code, 0);
    assert_eq!(plugin.next_seen().await, Seen::RemovePod("p1".into()));
    // StartContainer (the driver's limits are set there): by state change and by its own
    // call, answered with success.
    let change = Writer::default()
        .uint(1, START_CONTAINER)
        .bytes(2, &pod_bytes("p1"))
        .bytes(3, &container_bytes("c2", "p1", "main"));
    assert_eq!(peer.call("StateChange", &change.0, None).await.code, 0);
    assert_eq!(plugin.next_seen().await, Seen::Start("p1".into(), "c2".into()));
    let start = Writer::default()
        .bytes(1, &pod_bytes("p1"))
        .bytes(2, &container_bytes("c3", "p1", "main"));
    assert_eq!(peer.call("StartContainer", &start.0, None).await.code, 0);
    assert_eq!(plugin.next_seen().await, Seen::Start("p1".into(), "c3".into()));
    // An event without its container is acknowledged and goes no further.
    let change = Writer::default()
        .uint(1, START_CONTAINER)
        .bytes(2, &pod_bytes("p1"));
    assert_eq!(peer.call("StateChange", &change.0, None).await.code, 0);

    // Newer NRI: RemoveContainer{pod, container} and RemovePodSandbox{pod}.
    let remove = Writer::default()
        .bytes(1, &pod_bytes("p2"))
        .bytes(2, &container_bytes("c9", "p2", "main"));
    assert_eq!(peer.call("RemoveContainer", &remove.0, None).await.code, 0);
    assert_eq!(
        plugin.next_seen().await,
        Seen::RemoveContainer("p2".into(), "c9".into())
    );
    let remove = Writer::default().bytes(1, &pod_bytes("p2"));
    assert_eq!(peer.call("RemovePodSandbox", &remove.0, None).await.code, 0);
    assert_eq!(plugin.next_seen().await, Seen::RemovePod("p2".into()));

    // A method the plugin does not serve: Unimplemented, which newer runtimes take as "use
    // StateChange"; the connection stays.
    let answer = peer.call("UpdatePodSandbox", &[], None).await;
    assert_eq!(answer.code, 12, "{}", answer.message);
    assert!(
        plugin.seen.try_recv().is_err(),
        "the START_CONTAINER change reached the handler"
    );
    assert_eq!(
        peer.call("CreateContainer", &create_request("c10", "main"), None)
            .await
            .code,
        0
    );
}

#[tokio::test]
async fn a_split_synchronize_reaches_the_handler_whole() {
    let scratch = Scratch::new("split");
    let listener = UnixListener::bind(scratch.socket()).expect("bind");
    let mut plugin = Plugin::start(&scratch.socket(), Duration::from_secs(5));
    let mut peer = Peer::accept(&listener).await;
    peer.expect_register().await;
    assert_eq!(peer.call("Configure", &[], None).await.code, 0);

    let first = Writer::default().bytes(1, &pod_bytes("p1")).uint(3, 1);
    let answer = peer.call("Synchronize", &first.0, None).await;
    assert_eq!(
        (answer.code, pb::uint(&answer.payload, 2)),
        (0, 1),
        "more: echoed"
    );
    assert!(!*plugin.connected.borrow());
    let last = Writer::default()
        .bytes(1, &pod_bytes("p2"))
        .bytes(2, &container_bytes("c1", "p2", "main"));
    let answer = peer.call("Synchronize", &last.0, None).await;
    assert_eq!((answer.code, pb::uint(&answer.payload, 2)), (0, 0));
    assert_eq!(
        plugin.next_seen().await,
        Seen::Sync(
            vec![expected_pod("p1"), expected_pod("p2")],
            vec![expected_container("c1", "p2", "main")]
        )
    );
    plugin.wait_connected(true).await;
}

#[tokio::test]
async fn the_plugin_comes_back_after_the_runtime_restarts() {
    let (scratch, listener, mut plugin, peer) =
        synchronized("restart", Duration::from_secs(5)).await;

    // The runtime goes away, socket and all, then comes back on the same path.
    drop(peer);
    drop(listener);
    std::fs::remove_file(scratch.socket()).expect("remove the socket");
    plugin.wait_connected(false).await;
    let listener = UnixListener::bind(scratch.socket()).expect("bind again");
    let mut peer = reconnected(&listener, &mut plugin).await;
    assert_eq!(
        peer.call("CreateContainer", &create_request("c1", "main"), None)
            .await
            .code,
        0
    );
}

/// A `tracing` writer into a shared buffer.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Logs {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("log buffer").extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Logs {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().expect("log buffer")).into_owned()
    }
}

#[tokio::test]
async fn malformed_input_drops_the_connection_with_a_logged_reason_and_the_plugin_comes_back() {
    let logs = Logs::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    // The test's runtime is current-thread: the plugin's tasks log on this thread.
    let _logging = tracing::subscriber::set_default(subscriber);

    let scratch = Scratch::new("malformed");
    let listener = UnixListener::bind(scratch.socket()).expect("bind");
    let mut plugin = Plugin::start(&scratch.socket(), Duration::from_secs(5));
    let cases: [(&str, Vec<u8>); 4] = [
        // A frame header announcing 16 MiB + 1.
        (
            "over the limit of 16777216",
            [&[0, 0, 0, 1][..], &[0x01, 0, 0, 1]].concat(),
        ),
        // A frame for the reserved connection 0.
        ("connection 0", [&[0, 0, 0, 0][..], &[0, 0, 0, 0]].concat()),
        // A ttRPC message header announcing 16 MiB + 1, inside a small frame.
        (
            "ttRPC message of 16777217 bytes",
            [
                &[0, 0, 0, 1, 0, 0, 0, 10][..],
                &[0x01, 0, 0, 1, 0, 0, 0, 1, 1, 0],
            ]
            .concat(),
        ),
        // A request whose payload is no protobuf (field 1, length 5, 1 byte).
        (
            "malformed ttRPC request",
            [
                &[0, 0, 0, 1, 0, 0, 0, 13][..],
                &[0, 0, 0, 3, 0, 0, 0, 1, 1, 0, 0x0a, 5, b'x'],
            ]
            .concat(),
        ),
    ];
    for (reason, bytes) in cases {
        let mut peer = reconnected(&listener, &mut plugin).await;
        peer.stream.write_all(&bytes).await.expect("writing");
        assert!(peer.closed().await);
        plugin.wait_connected(false).await;
        let logged = logs.text();
        assert!(
            logged.contains(reason),
            "{reason:?} not in the logs:\n{logged}"
        );
    }
    // And it came back after the last one.
    reconnected(&listener, &mut plugin).await;
}

#[test]
fn config_check_refuses_what_the_runtime_would() {
    let good = Config {
        socket: "/x".into(),
        name: "vramguard".into(),
        index: "10".into(),
        handler_deadline: Duration::from_secs(1),
    };
    assert_eq!(good.check(), Ok(()));
    for index in ["1", "100", "a0", ""] {
        assert!(
            Config {
                index: index.into(),
                ..good.clone()
            }
            .check()
            .is_err(),
            "index {index:?}"
        );
    }
    for name in ["", "a b", "x/y"] {
        assert!(
            Config {
                name: name.into(),
                ..good.clone()
            }
            .check()
            .is_err(),
            "name {name:?}"
        );
    }
    assert!(Config {
        handler_deadline: Duration::ZERO,
        ..good
    }
    .check()
    .is_err());
}
