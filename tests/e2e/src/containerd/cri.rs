//! A client for the subset of the CRI (`runtime.v1.RuntimeService`, and `ImageService`'s
//! `ImageStatus`) the end-to-end tests use,
//! over a runtime's unix socket.
//!
//! The messages are hand-written prost structs carrying only the fields the tests set or read;
//! names and field numbers are those of the CRI's `api.proto` (cri-api 0.32, Debian's
//! `golang-github-kubernetes-cri-api-dev`). Fields left out are skipped by the decoder, as
//! protobuf allows. A unary gRPC call is an HTTP/2 POST to `/runtime.v1.<Service>/<Rpc>`
//! whose bodies are length-prefixed messages (1 byte "compressed" = 0, 4 bytes big-endian
//! length, the message) and whose outcome is the `grpc-status` trailer (or header, for a
//! trailers-only answer). Each call opens a connection of its own, so a client outlives a
//! runtime restart.
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use bytes::{Buf, BufMut, Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use hyper::header::{HeaderMap, HeaderValue, CONTENT_TYPE, TE};
use hyper_util::rt::{TokioExecutor, TokioIo};
use prost::Message;

/// `NamespaceMode`: one namespace shared by the pod's containers.
pub const NAMESPACE_POD: i32 = 0;
/// `NamespaceMode`: a namespace of the container's own.
pub const NAMESPACE_CONTAINER: i32 = 1;
/// `NamespaceMode`: the node's (host's) namespace.
pub const NAMESPACE_NODE: i32 = 2;

/// `ContainerState` values.
pub const CONTAINER_CREATED: i32 = 0;
pub const CONTAINER_RUNNING: i32 = 1;
pub const CONTAINER_EXITED: i32 = 2;

#[derive(Clone, PartialEq, Message)]
pub struct VersionRequest {
    #[prost(string, tag = "1")]
    pub version: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct VersionResponse {
    #[prost(string, tag = "1")]
    pub version: String,
    #[prost(string, tag = "2")]
    pub runtime_name: String,
    #[prost(string, tag = "3")]
    pub runtime_version: String,
    #[prost(string, tag = "4")]
    pub runtime_api_version: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct Mount {
    #[prost(string, tag = "1")]
    pub container_path: String,
    #[prost(string, tag = "2")]
    pub host_path: String,
    #[prost(bool, tag = "3")]
    pub readonly: bool,
    /// `MountPropagation`: [`PROPAGATION_PRIVATE`] or [`PROPAGATION_HOST_TO_CONTAINER`].
    #[prost(int32, tag = "5")]
    pub propagation: i32,
}

/// `MountPropagation` values (Kubernetes' `mountPropagation: None`, `HostToContainer`).
pub const PROPAGATION_PRIVATE: i32 = 0;
pub const PROPAGATION_HOST_TO_CONTAINER: i32 = 1;

/// `SecurityProfile.ProfileType`: the runtime's default profile (`RuntimeDefault`).
pub const PROFILE_RUNTIME_DEFAULT: i32 = 0;
/// `SecurityProfile.ProfileType`: no profile (`Unconfined`).
pub const PROFILE_UNCONFINED: i32 = 1;

/// Capabilities added to and dropped from the runtime's default set (names as Kubernetes
/// writes them, without `CAP_`; `ALL` drops every one).
#[derive(Clone, PartialEq, Message)]
pub struct Capability {
    #[prost(string, repeated, tag = "1")]
    pub add_capabilities: Vec<String>,
    #[prost(string, repeated, tag = "2")]
    pub drop_capabilities: Vec<String>,
}

#[derive(Clone, PartialEq, Message)]
pub struct Int64Value {
    #[prost(int64, tag = "1")]
    pub value: i64,
}

/// A seccomp or AppArmor profile.
#[derive(Clone, PartialEq, Message)]
pub struct SecurityProfile {
    #[prost(int32, tag = "1")]
    pub profile_type: i32,
    #[prost(string, tag = "2")]
    pub localhost_ref: String,
}

/// A host device node given to a container (the kubelet passes a device plugin's this way).
#[derive(Clone, PartialEq, Message)]
pub struct Device {
    #[prost(string, tag = "1")]
    pub container_path: String,
    #[prost(string, tag = "2")]
    pub host_path: String,
    /// cgroup permissions: `r`, `w`, `m`.
    #[prost(string, tag = "3")]
    pub permissions: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct NamespaceOption {
    #[prost(int32, tag = "1")]
    pub network: i32,
    #[prost(int32, tag = "2")]
    pub pid: i32,
    #[prost(int32, tag = "3")]
    pub ipc: i32,
}

#[derive(Clone, PartialEq, Message)]
pub struct LinuxSandboxSecurityContext {
    #[prost(message, optional, tag = "1")]
    pub namespace_options: Option<NamespaceOption>,
}

#[derive(Clone, PartialEq, Message)]
pub struct LinuxPodSandboxConfig {
    #[prost(string, tag = "1")]
    pub cgroup_parent: String,
    #[prost(message, optional, tag = "2")]
    pub security_context: Option<LinuxSandboxSecurityContext>,
}

#[derive(Clone, PartialEq, Message)]
pub struct PodSandboxMetadata {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub uid: String,
    #[prost(string, tag = "3")]
    pub namespace: String,
    #[prost(uint32, tag = "4")]
    pub attempt: u32,
}

#[derive(Clone, PartialEq, Message)]
pub struct PodSandboxConfig {
    #[prost(message, optional, tag = "1")]
    pub metadata: Option<PodSandboxMetadata>,
    #[prost(string, tag = "2")]
    pub hostname: String,
    #[prost(string, tag = "3")]
    pub log_directory: String,
    #[prost(map = "string, string", tag = "6")]
    pub labels: HashMap<String, String>,
    #[prost(map = "string, string", tag = "7")]
    pub annotations: HashMap<String, String>,
    #[prost(message, optional, tag = "8")]
    pub linux: Option<LinuxPodSandboxConfig>,
}

#[derive(Clone, PartialEq, Message)]
pub struct RunPodSandboxRequest {
    #[prost(message, optional, tag = "1")]
    pub config: Option<PodSandboxConfig>,
    #[prost(string, tag = "2")]
    pub runtime_handler: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct RunPodSandboxResponse {
    #[prost(string, tag = "1")]
    pub pod_sandbox_id: String,
}

/// The request of StopPodSandbox and RemovePodSandbox.
#[derive(Clone, PartialEq, Message)]
pub struct PodSandboxIdRequest {
    #[prost(string, tag = "1")]
    pub pod_sandbox_id: String,
}

/// An answer without fields (StopPodSandbox, StartContainer, ...).
#[derive(Clone, PartialEq, Message)]
pub struct Empty {}

#[derive(Clone, PartialEq, Message)]
pub struct ListPodSandboxRequest {}

#[derive(Clone, PartialEq, Message)]
pub struct PodSandbox {
    #[prost(string, tag = "1")]
    pub id: String,
    #[prost(message, optional, tag = "2")]
    pub metadata: Option<PodSandboxMetadata>,
    #[prost(int32, tag = "3")]
    pub state: i32,
}

#[derive(Clone, PartialEq, Message)]
pub struct ListPodSandboxResponse {
    #[prost(message, repeated, tag = "1")]
    pub items: Vec<PodSandbox>,
}

#[derive(Clone, PartialEq, Message)]
pub struct ImageSpec {
    #[prost(string, tag = "1")]
    pub image: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct ImageStatusRequest {
    #[prost(message, optional, tag = "1")]
    pub image: Option<ImageSpec>,
}

#[derive(Clone, PartialEq, Message)]
pub struct ImageStatusResponse {
    #[prost(message, optional, tag = "1")]
    pub image: Option<Image>,
}

/// `Image`: only its id.
#[derive(Clone, PartialEq, Message)]
pub struct Image {
    #[prost(string, tag = "1")]
    pub id: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct KeyValue {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(string, tag = "2")]
    pub value: String,
}

/// What a kubelet makes of a container's `securityContext` (and the pod's `hostPID`).
#[derive(Clone, PartialEq, Message)]
pub struct LinuxContainerSecurityContext {
    #[prost(message, optional, tag = "1")]
    pub capabilities: Option<Capability>,
    #[prost(bool, tag = "2")]
    pub privileged: bool,
    #[prost(message, optional, tag = "3")]
    pub namespace_options: Option<NamespaceOption>,
    #[prost(message, optional, tag = "5")]
    pub run_as_user: Option<Int64Value>,
    #[prost(bool, tag = "7")]
    pub readonly_rootfs: bool,
    /// `allowPrivilegeEscalation: false`.
    #[prost(bool, tag = "11")]
    pub no_new_privs: bool,
    #[prost(message, optional, tag = "15")]
    pub seccomp: Option<SecurityProfile>,
    #[prost(message, optional, tag = "16")]
    pub apparmor: Option<SecurityProfile>,
}

#[derive(Clone, PartialEq, Message)]
pub struct LinuxContainerConfig {
    #[prost(message, optional, tag = "2")]
    pub security_context: Option<LinuxContainerSecurityContext>,
}

#[derive(Clone, PartialEq, Message)]
pub struct ContainerMetadata {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(uint32, tag = "2")]
    pub attempt: u32,
}

#[derive(Clone, PartialEq, Message)]
pub struct ContainerConfig {
    #[prost(message, optional, tag = "1")]
    pub metadata: Option<ContainerMetadata>,
    #[prost(message, optional, tag = "2")]
    pub image: Option<ImageSpec>,
    #[prost(string, repeated, tag = "3")]
    pub command: Vec<String>,
    #[prost(string, repeated, tag = "4")]
    pub args: Vec<String>,
    #[prost(string, tag = "5")]
    pub working_dir: String,
    #[prost(message, repeated, tag = "6")]
    pub envs: Vec<KeyValue>,
    #[prost(message, repeated, tag = "7")]
    pub mounts: Vec<Mount>,
    #[prost(message, repeated, tag = "8")]
    pub devices: Vec<Device>,
    #[prost(map = "string, string", tag = "9")]
    pub labels: HashMap<String, String>,
    #[prost(map = "string, string", tag = "10")]
    pub annotations: HashMap<String, String>,
    #[prost(string, tag = "11")]
    pub log_path: String,
    #[prost(message, optional, tag = "15")]
    pub linux: Option<LinuxContainerConfig>,
    /// `CDI_devices`: the CDI devices the kubelet got from DRA drivers (Kubernetes 1.28 on).
    #[prost(message, repeated, tag = "17")]
    pub cdi_devices: Vec<CdiDevice>,
}

/// `CDIDevice`: a fully qualified CDI device name.
#[derive(Clone, PartialEq, Message)]
pub struct CdiDevice {
    #[prost(string, tag = "1")]
    pub name: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct CreateContainerRequest {
    #[prost(string, tag = "1")]
    pub pod_sandbox_id: String,
    #[prost(message, optional, tag = "2")]
    pub config: Option<ContainerConfig>,
    #[prost(message, optional, tag = "3")]
    pub sandbox_config: Option<PodSandboxConfig>,
}

#[derive(Clone, PartialEq, Message)]
pub struct CreateContainerResponse {
    #[prost(string, tag = "1")]
    pub container_id: String,
}

/// The request of StartContainer and RemoveContainer.
#[derive(Clone, PartialEq, Message)]
pub struct ContainerIdRequest {
    #[prost(string, tag = "1")]
    pub container_id: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct StopContainerRequest {
    #[prost(string, tag = "1")]
    pub container_id: String,
    /// Seconds between the stop signal and SIGKILL.
    #[prost(int64, tag = "2")]
    pub timeout: i64,
}

#[derive(Clone, PartialEq, Message)]
pub struct ContainerStatusRequest {
    #[prost(string, tag = "1")]
    pub container_id: String,
    #[prost(bool, tag = "2")]
    pub verbose: bool,
}

#[derive(Clone, PartialEq, Message)]
pub struct ContainerStatus {
    #[prost(string, tag = "1")]
    pub id: String,
    #[prost(message, optional, tag = "2")]
    pub metadata: Option<ContainerMetadata>,
    #[prost(int32, tag = "3")]
    pub state: i32,
    #[prost(int32, tag = "7")]
    pub exit_code: i32,
    #[prost(string, tag = "10")]
    pub reason: String,
    #[prost(string, tag = "11")]
    pub message: String,
    #[prost(map = "string, string", tag = "13")]
    pub annotations: HashMap<String, String>,
    #[prost(message, repeated, tag = "14")]
    pub mounts: Vec<Mount>,
}

#[derive(Clone, PartialEq, Message)]
pub struct ContainerStatusResponse {
    #[prost(message, optional, tag = "1")]
    pub status: Option<ContainerStatus>,
    /// With `verbose`: containerd's `info` key holds a JSON document (pid, runtime spec, ...).
    #[prost(map = "string, string", tag = "2")]
    pub info: HashMap<String, String>,
}

#[derive(Clone, PartialEq, Message)]
pub struct ExecSyncRequest {
    #[prost(string, tag = "1")]
    pub container_id: String,
    #[prost(string, repeated, tag = "2")]
    pub cmd: Vec<String>,
    /// Seconds; 0 means none.
    #[prost(int64, tag = "3")]
    pub timeout: i64,
}

#[derive(Clone, PartialEq, Message)]
pub struct ExecSyncResponse {
    #[prost(bytes = "vec", tag = "1")]
    pub stdout: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub stderr: Vec<u8>,
    #[prost(int32, tag = "3")]
    pub exit_code: i32,
}

/// The largest answer accepted (containerd's own default limit is 16 MiB).
const MAX_MESSAGE: usize = 16 << 20;

/// A CRI client for the runtime listening on a unix socket.
pub struct Client {
    socket: PathBuf,
    runtime: tokio::runtime::Runtime,
    /// How long one call may take.
    timeout: Duration,
}

impl Client {
    /// A client of the runtime at `socket` (nothing is connected until a call).
    pub fn new(socket: &Path, timeout: Duration) -> Result<Client> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .context("cannot build the CRI client's runtime")?;
        Ok(Client { socket: socket.to_path_buf(), runtime, timeout })
    }

    /// Calls `runtime.v1.RuntimeService/<method>`.
    pub fn call<Req: Message, Resp: Message + Default>(&self, method: &str, request: &Req) -> Result<Resp> {
        self.call_on("RuntimeService", method, request)
    }

    /// Calls `runtime.v1.<service>/<method>` (`RuntimeService`, `ImageService`).
    pub fn call_on<Req: Message, Resp: Message + Default>(&self, service: &str, method: &str, request: &Req) -> Result<Resp> {
        let path = format!("{service}/{method}");
        let future = unary(&self.socket, &path, request.encode_to_vec());
        let bytes = self
            .runtime
            .block_on(async { tokio::time::timeout(self.timeout, future).await })
            .map_err(|_| anyhow!("CRI {method}: no answer within {:?}", self.timeout))??;
        Resp::decode(bytes).with_context(|| format!("CRI {method}: the answer does not decode"))
    }

    pub fn version(&self) -> Result<VersionResponse> {
        self.call("Version", &VersionRequest { version: "v1".into() })
    }

    /// Whether CRI's image service knows `image` (its `ImageStatus` names an image).
    pub fn has_image(&self, image: &str) -> Result<bool> {
        let answer: ImageStatusResponse = self.call_on("ImageService", "ImageStatus", &ImageStatusRequest { image: Some(ImageSpec { image: image.into() }) })?;
        Ok(answer.image.is_some_and(|i| !i.id.is_empty()))
    }
}

/// One unary call on a connection of its own; the answer's message bytes.
async fn unary(socket: &Path, method: &str, message: Vec<u8>) -> Result<Bytes> {
    let stream = tokio::net::UnixStream::connect(socket)
        .await
        .with_context(|| format!("cannot connect to the CRI socket {}", socket.display()))?;
    let (mut sender, connection) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
        .await
        .context("HTTP/2 handshake with the CRI socket")?;
    let driver = tokio::spawn(connection);
    let mut body = BytesMut::with_capacity(5 + message.len());
    body.put_u8(0);
    body.put_u32(u32::try_from(message.len()).context("CRI request too large")?);
    body.put_slice(&message);
    let request = hyper::Request::post(format!("http://localhost/runtime.v1.{method}"))
        .header(CONTENT_TYPE, HeaderValue::from_static("application/grpc"))
        .header(TE, HeaderValue::from_static("trailers"))
        .body(Full::new(body.freeze()))
        .context("building the CRI request")?;
    let response = sender.send_request(request).await.with_context(|| format!("CRI {method}: request failed"))?;
    let (parts, body) = response.into_parts();
    if parts.status != hyper::StatusCode::OK {
        bail!("CRI {method}: HTTP status {}", parts.status);
    }
    let collected = body.collect().await.with_context(|| format!("CRI {method}: reading the answer"))?;
    let trailers = collected.trailers().cloned();
    let data = collected.to_bytes();
    driver.abort();
    // A trailers-only answer carries the status in its headers.
    let status_from = trailers.as_ref().filter(|t| t.contains_key("grpc-status")).unwrap_or(&parts.headers);
    check_status(method, status_from)?;
    unframe(data).with_context(|| format!("CRI {method}: malformed answer"))
}

/// Fails with the gRPC status code and message unless the status is OK (0).
fn check_status(method: &str, headers: &HeaderMap) -> Result<()> {
    let code = headers
        .get("grpc-status")
        .ok_or_else(|| anyhow!("CRI {method}: no grpc-status in the answer"))?
        .to_str()
        .ok()
        .and_then(|s| s.parse::<u32>().ok())
        .ok_or_else(|| anyhow!("CRI {method}: grpc-status is not a number"))?;
    if code == 0 {
        return Ok(());
    }
    let message = headers.get("grpc-message").map(|m| percent_decode(m.as_bytes())).unwrap_or_default();
    bail!("CRI {method} failed: gRPC status {code}: {message}")
}

/// gRPC's `grpc-message` is percent-encoded.
fn percent_decode(bytes: &[u8]) -> String {
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The one message of a unary answer's body.
fn unframe(mut data: Bytes) -> Result<Bytes> {
    if data.len() < 5 {
        bail!("{} bytes, less than a message's 5-byte prefix", data.len());
    }
    let compressed = data.get_u8();
    let length = data.get_u32() as usize;
    if compressed != 0 {
        bail!("a compressed message (none was asked for)");
    }
    if length > MAX_MESSAGE || length != data.len() {
        bail!("the prefix says {length} bytes, {} follow", data.len());
    }
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unframes_one_message() {
        let framed = Bytes::from_static(&[0, 0, 0, 0, 2, 8, 1]);
        assert_eq!(unframe(framed).unwrap(), Bytes::from_static(&[8, 1]));
        assert!(unframe(Bytes::from_static(&[0, 0, 0, 0, 3, 8, 1])).is_err());
        assert!(unframe(Bytes::from_static(&[1, 0, 0, 0, 0])).is_err());
        assert!(unframe(Bytes::from_static(&[0, 0])).is_err());
    }

    #[test]
    fn decodes_grpc_messages() {
        assert_eq!(percent_decode(b"not%20found: x%2"), "not found: x%2");
        assert_eq!(percent_decode(b"%E2%9C%93"), "\u{2713}");
    }
}
