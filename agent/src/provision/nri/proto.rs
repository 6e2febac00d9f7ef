//! The protobuf messages the plugin exchanges with the runtime: the subset of NRI's
//! `pkg/api/api.proto` (package `nri.pkg.api.v1alpha1`) the plugin uses, and ttRPC's envelope
//! (`Request`, `Response`, and `google.rpc.Status`).
//!
//! Written by hand with `prost`'s derive (no protoc, no code generation). Field numbers are the
//! proto's; each one used here exists in NRI 0.6.1 (what containerd 1.7.24 in Debian trixie is
//! built with) and in NRI's later versions, except where a doc line says "newer NRI", which an
//! older runtime never sends and never reads. Fields the plugin does not use are left out: prost
//! skips unknown fields when decoding.
use std::collections::BTreeMap;

/// The ttRPC service the runtime serves on the mux's runtime connection.
pub const RUNTIME_SERVICE: &str = "nri.pkg.api.v1alpha1.Runtime";
/// The ttRPC service the plugin serves on the mux's plugin connection.
pub const PLUGIN_SERVICE: &str = "nri.pkg.api.v1alpha1.Plugin";

/// NRI's `Event` enum: the values the plugin subscribes to or sees in a `StateChangeEvent`.
pub mod event {
    pub const REMOVE_POD_SANDBOX: i32 = 3;
    pub const CREATE_CONTAINER: i32 = 4;
    pub const START_CONTAINER: i32 = 6;
    pub const REMOVE_CONTAINER: i32 = 11;

    /// The bit of `event` in `ConfigureResponse.events`.
    pub const fn bit(event: i32) -> i32 {
        1 << (event - 1)
    }
}

/// ttRPC status codes (gRPC's numbering) the plugin answers with.
pub mod code {
    pub const OK: i32 = 0;
    pub const UNKNOWN: i32 = 2;
    pub const INVALID_ARGUMENT: i32 = 3;
    pub const DEADLINE_EXCEEDED: i32 = 4;
    pub const RESOURCE_EXHAUSTED: i32 = 8;
    pub const UNIMPLEMENTED: i32 = 12;
}

/// ttRPC `Request` (ttrpc's `request.proto`): one call, as the request message's payload.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Request {
    #[prost(string, tag = "1")]
    pub service: String,
    #[prost(string, tag = "2")]
    pub method: String,
    #[prost(bytes = "vec", tag = "3")]
    pub payload: Vec<u8>,
    /// The caller's deadline, relative, in nanoseconds; 0: none.
    #[prost(int64, tag = "4")]
    pub timeout_nano: i64,
}

/// ttRPC `Response` (ttrpc's `request.proto`): a call's outcome.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Response {
    #[prost(message, optional, tag = "1")]
    pub status: Option<Status>,
    #[prost(bytes = "vec", tag = "2")]
    pub payload: Vec<u8>,
}

/// `google.rpc.Status`: a call's status code and message.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Status {
    #[prost(int32, tag = "1")]
    pub code: i32,
    #[prost(string, tag = "2")]
    pub message: String,
}

/// NRI `Empty`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Empty {}

/// NRI `RegisterPluginRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RegisterPluginRequest {
    #[prost(string, tag = "1")]
    pub plugin_name: String,
    #[prost(string, tag = "2")]
    pub plugin_idx: String,
}

/// NRI `ConfigureRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ConfigureRequest {
    #[prost(string, tag = "2")]
    pub runtime_name: String,
    #[prost(string, tag = "3")]
    pub runtime_version: String,
    /// Milliseconds; newer NRI only.
    #[prost(int64, tag = "5")]
    pub request_timeout: i64,
}

/// NRI `ConfigureResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ConfigureResponse {
    /// The subscribed events, one bit each ([`event::bit`]); 0 means all.
    #[prost(int32, tag = "2")]
    pub events: i32,
}

/// NRI `SynchronizeRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SynchronizeRequest {
    #[prost(message, repeated, tag = "1")]
    pub pods: Vec<PodSandbox>,
    #[prost(message, repeated, tag = "2")]
    pub containers: Vec<Container>,
    /// More pods and containers follow in another request (newer NRI's split synchronization).
    #[prost(bool, tag = "3")]
    pub more: bool,
}

/// NRI `SynchronizeResponse` (no container updates: the plugin never asks for any).
#[derive(Clone, PartialEq, prost::Message)]
pub struct SynchronizeResponse {
    /// Echoes the request's `more`: the plugin takes split synchronization (newer NRI).
    #[prost(bool, tag = "2")]
    pub more: bool,
}

/// NRI `CreateContainerRequest`; also the layout of `RemoveContainerRequest` (newer NRI).
#[derive(Clone, PartialEq, prost::Message)]
pub struct ContainerRequest {
    #[prost(message, optional, tag = "1")]
    pub pod: Option<PodSandbox>,
    #[prost(message, optional, tag = "2")]
    pub container: Option<Container>,
}

/// NRI `RemovePodSandboxRequest` (newer NRI).
#[derive(Clone, PartialEq, prost::Message)]
pub struct PodRequest {
    #[prost(message, optional, tag = "1")]
    pub pod: Option<PodSandbox>,
}

/// NRI `CreateContainerResponse` (no updates to or evictions of other containers).
#[derive(Clone, PartialEq, prost::Message)]
pub struct CreateContainerResponse {
    #[prost(message, optional, tag = "1")]
    pub adjust: Option<ContainerAdjustment>,
}

/// NRI `StateChangeEvent`: how NRI 0.6 delivers RemoveContainer and RemovePodSandbox.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StateChangeEvent {
    #[prost(int32, tag = "1")]
    pub event: i32,
    #[prost(message, optional, tag = "2")]
    pub pod: Option<PodSandbox>,
    #[prost(message, optional, tag = "3")]
    pub container: Option<Container>,
}

/// NRI `PodSandbox`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PodSandbox {
    #[prost(string, tag = "1")]
    pub id: String,
    #[prost(string, tag = "2")]
    pub name: String,
    #[prost(string, tag = "3")]
    pub uid: String,
    #[prost(string, tag = "4")]
    pub namespace: String,
    #[prost(btree_map = "string, string", tag = "5")]
    pub labels: BTreeMap<String, String>,
    #[prost(btree_map = "string, string", tag = "6")]
    pub annotations: BTreeMap<String, String>,
}

/// NRI `Container`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Container {
    #[prost(string, tag = "1")]
    pub id: String,
    #[prost(string, tag = "2")]
    pub pod_sandbox_id: String,
    #[prost(string, tag = "3")]
    pub name: String,
    #[prost(btree_map = "string, string", tag = "6")]
    pub annotations: BTreeMap<String, String>,
    /// `KEY=value` entries.
    #[prost(string, repeated, tag = "8")]
    pub env: Vec<String>,
    /// The OCI spec's mounts (the runtime's, CDI's edits included).
    #[prost(message, repeated, tag = "9")]
    pub mounts: Vec<Mount>,
    #[prost(message, optional, tag = "11")]
    pub linux: Option<LinuxContainer>,
    #[prost(uint32, tag = "12")]
    pub pid: u32,
    /// The CDI devices the runtime injected (newer NRI).
    #[prost(message, repeated, tag = "20")]
    pub cdi_devices: Vec<CdiDevice>,
}

/// NRI `CDIDevice`: a fully qualified CDI device name (`vendor/class=name`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct CdiDevice {
    #[prost(string, tag = "1")]
    pub name: String,
}

/// NRI `LinuxContainer`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LinuxContainer {
    /// The OCI spec's `linux.devices`: the device nodes the container gets.
    #[prost(message, repeated, tag = "2")]
    pub devices: Vec<LinuxDevice>,
    #[prost(string, tag = "5")]
    pub cgroups_path: String,
}

/// NRI `LinuxDevice` (only its path in the container: the GPU's index is in its name).
#[derive(Clone, PartialEq, prost::Message)]
pub struct LinuxDevice {
    #[prost(string, tag = "1")]
    pub path: String,
}

/// NRI `ContainerAdjustment` (mounts and env only: the runtime's default validator may
/// refuse other adjustments).
#[derive(Clone, PartialEq, prost::Message)]
pub struct ContainerAdjustment {
    #[prost(message, repeated, tag = "3")]
    pub mounts: Vec<Mount>,
    #[prost(message, repeated, tag = "4")]
    pub env: Vec<KeyValue>,
}

/// NRI `Mount`: an OCI mount.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Mount {
    #[prost(string, tag = "1")]
    pub destination: String,
    #[prost(string, tag = "2")]
    pub r#type: String,
    #[prost(string, tag = "3")]
    pub source: String,
    #[prost(string, repeated, tag = "4")]
    pub options: Vec<String>,
}

/// NRI `KeyValue`: an environment variable.
#[derive(Clone, PartialEq, prost::Message)]
pub struct KeyValue {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(string, tag = "2")]
    pub value: String,
}
