//! The kubelet's plugin protocols as we compile them (`agent/proto/*.proto`, generated into
//! `agent::dra::proto`) pinned to the published Kubernetes API: every message's field numbers
//! and wire types, and every service's full method names as our generated servers route them.
//!
//! The golden facts below were read from the published API files of k8s.io/kubelet (the
//! kubernetes/kubelet repository, the mirror of kubernetes/kubernetes
//! `staging/src/k8s.io/kubelet`), at tag v0.36.0 (commit
//! eb8f71c979ae0c22dc2f15f76c6aae7dccd22a23); the three files are the same on its master at
//! 63b3249724f7d89a8aa48f9acb3811f193c9aa68 (2026-07-23):
//!
//! - `pkg/apis/dra/v1/api.proto`, package `k8s.io.kubelet.pkg.apis.dra.v1`, service `DRAPlugin`
//!   (last changed in 5aff898c, released in v0.35.0: `Device.share_id`, field 5, proto3
//!   `optional`);
//! - `pkg/apis/pluginregistration/v1/api.proto`, package `pluginregistration` (no version in
//!   the package name), service `Registration` (last changed in 3f57b9b2, v0.34.0);
//! - `pkg/apis/dra-health/v1alpha1/api.proto`, package `v1alpha1`, service `DRAResourceHealth`
//!   (last changed in eee7528e, v0.36.0: `DeviceHealth.message`, field 5).
//!
//! How it is checked, so that a drifted number, type or name fails here rather than only
//! against a real kubelet (the tests' kubelet uses our own generated clients, which would
//! agree with our servers whatever the numbers):
//!
//! - Messages: each upstream message is written below as a schema (field name, number, type,
//!   label). From it the test encodes a sample by hand (every field set to a non-default value:
//!   a string to its upstream field name, `name.0`/`name.1` when repeated, an int64 to a
//!   negative number made from its field number, a bool to true, an enum to its highest value,
//!   two elements in every repeated field and map), decodes those bytes with our prost type and
//!   compares the result with a struct literal naming every one of our fields (so a field added
//!   to or missing from our files does not compile); then it encodes that literal with prost and
//!   reads the bytes back with a wire reader written here, which refuses a field number the
//!   upstream message lacks or a wire type other than upstream's, and compares what it read with
//!   the sample.
//! - Services: our generated servers (`RegistrationServer`, `DraPluginServer`,
//!   `DraResourceHealthServer`) are served on a Unix socket with trivial implementations, and
//!   each upstream method's full path is called with a raw gRPC client (`tonic::client::Grpc`,
//!   the path given as a string, not taken from our generated clients); each call must reach its
//!   implementation with the request it sent. Misspelt paths are called too, to show that an
//!   unknown path is answered UNIMPLEMENTED.
use std::{
    collections::HashMap,
    fmt::Debug,
    sync::{Arc, Mutex},
    time::Duration,
};

use agent::dra::proto::{health, registration, v1};
use prost::Message;
use tonic::{codegen::http::uri::PathAndQuery, transport::Endpoint, Code, Request, Response, Status};
use tonic_prost::ProstCodec;

// ---------------------------------------------------------------------------------------------
// The upstream schemas.

/// A field's protobuf type, as upstream declares it.
#[derive(Clone, Copy)]
enum Ty {
    String,
    Bool,
    Int64,
    /// An enum: its values (name, number).
    Enum(&'static [(&'static str, i32)]),
    Message(&'static Schema),
    /// `map<string, V>`: on the wire, repeated entries with the key as field 1 and the value
    /// (a message here) as field 2.
    MapOfString(&'static Schema),
}

impl Ty {
    /// The wire type its values are encoded with (0: varint, 2: length-delimited).
    fn wire_type(self) -> u8 {
        match self {
            Ty::Bool | Ty::Int64 | Ty::Enum(_) => 0,
            Ty::String | Ty::Message(_) | Ty::MapOfString(_) => 2,
        }
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Label {
    /// A proto3 field without a label.
    Singular,
    /// proto3 `optional` (explicit presence).
    Optional,
    Repeated,
}

struct Field {
    name: &'static str,
    number: u32,
    ty: Ty,
    label: Label,
}

struct Schema {
    /// The message's full name.
    name: &'static str,
    fields: &'static [Field],
}

const fn field(name: &'static str, number: u32, ty: Ty, label: Label) -> Field {
    Field { name, number, ty, label }
}

use Label::{Optional, Repeated, Singular};

// pluginregistration v1 (package `pluginregistration`).
static INFO_REQUEST: Schema = Schema { name: "pluginregistration.InfoRequest", fields: &[] };
static PLUGIN_INFO: Schema = Schema {
    name: "pluginregistration.PluginInfo",
    fields: &[
        field("type", 1, Ty::String, Singular),
        field("name", 2, Ty::String, Singular),
        field("endpoint", 3, Ty::String, Singular),
        field("supported_versions", 4, Ty::String, Repeated),
    ],
};
static REGISTRATION_STATUS: Schema = Schema {
    name: "pluginregistration.RegistrationStatus",
    fields: &[field("plugin_registered", 1, Ty::Bool, Singular), field("error", 2, Ty::String, Singular)],
};
static REGISTRATION_STATUS_RESPONSE: Schema = Schema { name: "pluginregistration.RegistrationStatusResponse", fields: &[] };

// DRA v1 (package `k8s.io.kubelet.pkg.apis.dra.v1`).
static CLAIM: Schema = Schema {
    name: "k8s.io.kubelet.pkg.apis.dra.v1.Claim",
    fields: &[
        field("namespace", 1, Ty::String, Singular),
        field("uid", 2, Ty::String, Singular),
        field("name", 3, Ty::String, Singular),
    ],
};
static NODE_PREPARE_RESOURCES_REQUEST: Schema = Schema {
    name: "k8s.io.kubelet.pkg.apis.dra.v1.NodePrepareResourcesRequest",
    fields: &[field("claims", 1, Ty::Message(&CLAIM), Repeated)],
};
static NODE_PREPARE_RESOURCES_RESPONSE: Schema = Schema {
    name: "k8s.io.kubelet.pkg.apis.dra.v1.NodePrepareResourcesResponse",
    fields: &[field("claims", 1, Ty::MapOfString(&NODE_PREPARE_RESOURCE_RESPONSE), Repeated)],
};
static NODE_PREPARE_RESOURCE_RESPONSE: Schema = Schema {
    name: "k8s.io.kubelet.pkg.apis.dra.v1.NodePrepareResourceResponse",
    fields: &[field("devices", 1, Ty::Message(&DEVICE), Repeated), field("error", 2, Ty::String, Singular)],
};
static DEVICE: Schema = Schema {
    name: "k8s.io.kubelet.pkg.apis.dra.v1.Device",
    fields: &[
        field("request_names", 1, Ty::String, Repeated),
        field("pool_name", 2, Ty::String, Singular),
        field("device_name", 3, Ty::String, Singular),
        field("cdi_device_ids", 4, Ty::String, Repeated),
        field("share_id", 5, Ty::String, Optional),
    ],
};
static NODE_UNPREPARE_RESOURCES_REQUEST: Schema = Schema {
    name: "k8s.io.kubelet.pkg.apis.dra.v1.NodeUnprepareResourcesRequest",
    fields: &[field("claims", 1, Ty::Message(&CLAIM), Repeated)],
};
static NODE_UNPREPARE_RESOURCES_RESPONSE: Schema = Schema {
    name: "k8s.io.kubelet.pkg.apis.dra.v1.NodeUnprepareResourcesResponse",
    fields: &[field("claims", 1, Ty::MapOfString(&NODE_UNPREPARE_RESOURCE_RESPONSE), Repeated)],
};
static NODE_UNPREPARE_RESOURCE_RESPONSE: Schema = Schema {
    name: "k8s.io.kubelet.pkg.apis.dra.v1.NodeUnprepareResourceResponse",
    fields: &[field("error", 1, Ty::String, Singular)],
};

// DRA health v1alpha1 (package `v1alpha1`).
const HEALTH_STATUS: &[(&str, i32)] = &[("UNKNOWN", 0), ("HEALTHY", 1), ("UNHEALTHY", 2)];
static NODE_WATCH_RESOURCES_REQUEST: Schema = Schema { name: "v1alpha1.NodeWatchResourcesRequest", fields: &[] };
static DEVICE_IDENTIFIER: Schema = Schema {
    name: "v1alpha1.DeviceIdentifier",
    fields: &[field("pool_name", 1, Ty::String, Singular), field("device_name", 2, Ty::String, Singular)],
};
static DEVICE_HEALTH: Schema = Schema {
    name: "v1alpha1.DeviceHealth",
    fields: &[
        field("device", 1, Ty::Message(&DEVICE_IDENTIFIER), Singular),
        field("health", 2, Ty::Enum(HEALTH_STATUS), Singular),
        field("last_updated_time", 3, Ty::Int64, Singular),
        field("health_check_timeout_seconds", 4, Ty::Int64, Singular),
        field("message", 5, Ty::String, Singular),
    ],
};
static NODE_WATCH_RESOURCES_RESPONSE: Schema = Schema {
    name: "v1alpha1.NodeWatchResourcesResponse",
    fields: &[field("devices", 1, Ty::Message(&DEVICE_HEALTH), Repeated)],
};

/// Every upstream service's full method names, and whether the method streams its responses.
const METHODS: &[(&str, bool)] = &[
    ("/pluginregistration.Registration/GetInfo", false),
    ("/pluginregistration.Registration/NotifyRegistrationStatus", false),
    ("/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources", false),
    ("/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources", false),
    ("/v1alpha1.DRAResourceHealth/NodeWatchResources", true),
];

// ---------------------------------------------------------------------------------------------
// A message's decoded form, the sample made from a schema, and the wire writer and reader.

/// A message as read off the wire: its fields as (number, value), sorted.
type Tree = Vec<(u32, Value)>;

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Value {
    Varint(u64),
    String(String),
    Message(Tree),
}

/// An int64 field's sample: negative (ten bytes on the wire as int64; zigzag-encoded it would
/// differ), and different for each field number.
fn int64_sample(number: u32) -> i64 {
    -(1 << 40) - i64::from(number)
}

/// The sample of a message: every field set, repeated fields and maps to two elements.
fn sample(schema: &Schema) -> Tree {
    let mut tree = Tree::new();
    for field in schema.fields {
        let count = if field.label == Repeated { 2 } else { 1 };
        for index in 0..count {
            let text = if field.label == Repeated { format!("{}.{index}", field.name) } else { field.name.to_owned() };
            let value = match field.ty {
                Ty::String => Value::String(text),
                Ty::Bool => Value::Varint(1),
                Ty::Int64 => Value::Varint(int64_sample(field.number) as u64),
                Ty::Enum(values) => Value::Varint(values.iter().map(|&(_, number)| number).max().expect("an enum has values") as u64),
                Ty::Message(inner) => Value::Message(sample(inner)),
                Ty::MapOfString(inner) => Value::Message(vec![(1, Value::String(text)), (2, Value::Message(sample(inner)))]),
            };
            tree.push((field.number, value));
        }
    }
    tree.sort();
    tree
}

fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8 & 0x7f) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// Encodes a tree by hand: a tag (number << 3 | wire type), then the value.
fn encode(tree: &Tree) -> Vec<u8> {
    let mut out = Vec::new();
    for (number, value) in tree {
        match value {
            Value::Varint(v) => {
                put_varint(&mut out, u64::from(*number) << 3);
                put_varint(&mut out, *v);
            }
            Value::String(s) => {
                put_varint(&mut out, u64::from(*number) << 3 | 2);
                put_varint(&mut out, s.len() as u64);
                out.extend_from_slice(s.as_bytes());
            }
            Value::Message(inner) => {
                let bytes = encode(inner);
                put_varint(&mut out, u64::from(*number) << 3 | 2);
                put_varint(&mut out, bytes.len() as u64);
                out.extend_from_slice(&bytes);
            }
        }
    }
    out
}

fn get_varint(bytes: &[u8], at: &mut usize) -> u64 {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *bytes.get(*at).expect("a varint runs past the end of the message");
        *at += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return value;
        }
    }
    panic!("a varint longer than ten bytes");
}

/// Reads an encoded message against its upstream schema: every field's number must be one of
/// the schema's, with the schema's wire type.
fn read(schema: &Schema, bytes: &[u8]) -> Tree {
    let mut tree = Tree::new();
    let mut at = 0;
    while at < bytes.len() {
        let tag = get_varint(bytes, &mut at);
        let (number, wire_type) = ((tag >> 3) as u32, (tag & 7) as u8);
        let field = schema
            .fields
            .iter()
            .find(|field| field.number == number)
            .unwrap_or_else(|| panic!("{}: field number {number} (wire type {wire_type}) is not in the upstream message", schema.name));
        assert_eq!(wire_type, field.ty.wire_type(), "{}.{} (field {number}): wire type", schema.name, field.name);
        if field.label != Repeated {
            assert!(tree.iter().all(|(seen, _)| *seen != number), "{}.{}: a singular field encoded twice", schema.name, field.name);
        }
        let value = match wire_type {
            0 => Value::Varint(get_varint(bytes, &mut at)),
            _ => {
                let len = get_varint(bytes, &mut at) as usize;
                let payload = bytes.get(at..at + len).expect("a length-delimited field runs past the end of the message");
                at += len;
                match field.ty {
                    Ty::String => Value::String(String::from_utf8(payload.to_vec()).expect("a string field holds UTF-8")),
                    Ty::Message(inner) => Value::Message(read(inner, payload)),
                    Ty::MapOfString(inner) => Value::Message(read_entry(schema, field, inner, payload)),
                    Ty::Bool | Ty::Int64 | Ty::Enum(_) => unreachable!("wire type checked above"),
                }
            }
        };
        tree.push((number, value));
    }
    tree.sort();
    tree
}

/// A map entry: the key (a string) as field 1, the value (a message) as field 2.
fn read_entry(schema: &Schema, map: &Field, value_schema: &Schema, bytes: &[u8]) -> Tree {
    let mut tree = Tree::new();
    let mut at = 0;
    while at < bytes.len() {
        let tag = get_varint(bytes, &mut at);
        assert_eq!(tag & 7, 2, "{}.{}: a map entry's field {} is not length-delimited", schema.name, map.name, tag >> 3);
        let len = get_varint(bytes, &mut at) as usize;
        let payload = &bytes[at..at + len];
        at += len;
        let value = match tag >> 3 {
            1 => Value::String(String::from_utf8(payload.to_vec()).expect("a map key holds UTF-8")),
            2 => Value::Message(read(value_schema, payload)),
            other => panic!("{}.{}: a map entry has field {other} (key is 1, value 2)", schema.name, map.name),
        };
        tree.push(((tag >> 3) as u32, value));
    }
    tree.sort();
    tree
}

/// Pins one message: the upstream sample, encoded by hand, decodes with our prost type into
/// `expected` (our every field, named), and `expected` encoded by prost reads back as the
/// upstream sample.
fn pin<T: Message + Default + PartialEq + Debug>(schema: &Schema, expected: T) {
    let golden = sample(schema);
    let decoded = T::decode(encode(&golden).as_slice()).unwrap_or_else(|error| panic!("{}: our type cannot decode the upstream sample: {error}", schema.name));
    assert_eq!(decoded, expected, "{}: the upstream sample decoded with our type", schema.name);
    assert_eq!(read(schema, &expected.encode_to_vec()), golden, "{}: our encoding read against upstream", schema.name);
}

// ---------------------------------------------------------------------------------------------
// Our messages, every field set as `sample` sets it.

fn strings(name: &str) -> Vec<String> {
    vec![format!("{name}.0"), format!("{name}.1")]
}

fn claim() -> v1::Claim {
    v1::Claim { namespace: "namespace".into(), uid: "uid".into(), name: "name".into() }
}

fn device() -> v1::Device {
    v1::Device {
        request_names: strings("request_names"),
        pool_name: "pool_name".into(),
        device_name: "device_name".into(),
        cdi_device_ids: strings("cdi_device_ids"),
        share_id: Some("share_id".into()),
    }
}

fn prepare_response() -> v1::NodePrepareResourceResponse {
    v1::NodePrepareResourceResponse { devices: vec![device(), device()], error: "error".into() }
}

fn unprepare_response() -> v1::NodeUnprepareResourceResponse {
    v1::NodeUnprepareResourceResponse { error: "error".into() }
}

fn device_health() -> health::DeviceHealth {
    health::DeviceHealth {
        device: Some(health::DeviceIdentifier { pool_name: "pool_name".into(), device_name: "device_name".into() }),
        health: health::HealthStatus::Unhealthy as i32,
        last_updated_time: int64_sample(3),
        health_check_timeout_seconds: int64_sample(4),
        message: "message".into(),
    }
}

#[test]
fn pluginregistration_v1_messages() {
    pin(&INFO_REQUEST, registration::InfoRequest {});
    pin(
        &PLUGIN_INFO,
        registration::PluginInfo {
            r#type: "type".into(),
            name: "name".into(),
            endpoint: "endpoint".into(),
            supported_versions: strings("supported_versions"),
        },
    );
    pin(&REGISTRATION_STATUS, registration::RegistrationStatus { plugin_registered: true, error: "error".into() });
    pin(&REGISTRATION_STATUS_RESPONSE, registration::RegistrationStatusResponse {});
}

#[test]
fn dra_v1_messages() {
    pin(&CLAIM, claim());
    pin(&DEVICE, device());
    pin(&NODE_PREPARE_RESOURCE_RESPONSE, prepare_response());
    pin(&NODE_UNPREPARE_RESOURCE_RESPONSE, unprepare_response());
    pin(&NODE_PREPARE_RESOURCES_REQUEST, v1::NodePrepareResourcesRequest { claims: vec![claim(), claim()] });
    pin(&NODE_UNPREPARE_RESOURCES_REQUEST, v1::NodeUnprepareResourcesRequest { claims: vec![claim(), claim()] });
    pin(
        &NODE_PREPARE_RESOURCES_RESPONSE,
        v1::NodePrepareResourcesResponse { claims: HashMap::from([("claims.0".into(), prepare_response()), ("claims.1".into(), prepare_response())]) },
    );
    pin(
        &NODE_UNPREPARE_RESOURCES_RESPONSE,
        v1::NodeUnprepareResourcesResponse {
            claims: HashMap::from([("claims.0".into(), unprepare_response()), ("claims.1".into(), unprepare_response())]),
        },
    );
}

/// `Device.share_id` is proto3 `optional` upstream: an empty share ID is sent (field 5, empty),
/// and an absent one is not.
#[test]
fn dra_v1_share_id_has_presence() {
    let with = |share_id: Option<&str>| v1::Device { share_id: share_id.map(str::to_owned), ..Default::default() };
    assert_eq!(with(Some("")).encode_to_vec(), [5 << 3 | 2, 0]);
    assert_eq!(with(None).encode_to_vec(), [] as [u8; 0]);
    assert_eq!(v1::Device::decode([5 << 3 | 2, 0].as_slice()).expect("decode"), with(Some("")));
}

#[test]
fn dra_health_v1alpha1_messages() {
    pin(&NODE_WATCH_RESOURCES_REQUEST, health::NodeWatchResourcesRequest {});
    pin(&DEVICE_IDENTIFIER, health::DeviceIdentifier { pool_name: "pool_name".into(), device_name: "device_name".into() });
    pin(&DEVICE_HEALTH, device_health());
    pin(&NODE_WATCH_RESOURCES_RESPONSE, health::NodeWatchResourcesResponse { devices: vec![device_health(), device_health()] });
}

#[test]
fn dra_health_v1alpha1_health_status_values() {
    for &(name, number) in HEALTH_STATUS {
        let ours = health::HealthStatus::from_str_name(name).unwrap_or_else(|| panic!("HealthStatus has no {name}"));
        assert_eq!(ours as i32, number, "HealthStatus {name}");
        assert_eq!(ours.as_str_name(), name);
    }
    let ours = (-8..64).filter(|&number| health::HealthStatus::try_from(number).is_ok()).count();
    assert_eq!(ours, HEALTH_STATUS.len(), "HealthStatus has values upstream lacks");
}

// ---------------------------------------------------------------------------------------------
// The services: our generated servers, called by path.

/// What the servers were called with, as "method request".
#[derive(Clone, Default)]
struct Calls(Arc<Mutex<Vec<String>>>);

impl Calls {
    fn record(&self, method: &str, request: &impl Debug) {
        self.0.lock().expect("calls").push(format!("{method} {request:?}"));
    }

    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.0.lock().expect("calls"))
    }
}

#[tonic::async_trait]
impl registration::registration_server::Registration for Calls {
    async fn get_info(&self, request: Request<registration::InfoRequest>) -> Result<Response<registration::PluginInfo>, Status> {
        self.record("GetInfo", request.get_ref());
        Ok(Response::new(registration::PluginInfo { name: "served GetInfo".into(), ..Default::default() }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<registration::RegistrationStatus>,
    ) -> Result<Response<registration::RegistrationStatusResponse>, Status> {
        self.record("NotifyRegistrationStatus", request.get_ref());
        Ok(Response::new(registration::RegistrationStatusResponse {}))
    }
}

#[tonic::async_trait]
impl v1::dra_plugin_server::DraPlugin for Calls {
    async fn node_prepare_resources(
        &self,
        request: Request<v1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1::NodePrepareResourcesResponse>, Status> {
        self.record("NodePrepareResources", request.get_ref());
        let claims = request.get_ref().claims.iter().map(|claim| (claim.uid.clone(), prepare_response())).collect();
        Ok(Response::new(v1::NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<v1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1::NodeUnprepareResourcesResponse>, Status> {
        self.record("NodeUnprepareResources", request.get_ref());
        let claims = request.get_ref().claims.iter().map(|claim| (claim.uid.clone(), unprepare_response())).collect();
        Ok(Response::new(v1::NodeUnprepareResourcesResponse { claims }))
    }
}

#[tonic::async_trait]
impl health::dra_resource_health_server::DraResourceHealth for Calls {
    type NodeWatchResourcesStream = tokio_stream::Iter<std::vec::IntoIter<Result<health::NodeWatchResourcesResponse, Status>>>;

    async fn node_watch_resources(
        &self,
        request: Request<health::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        self.record("NodeWatchResources", request.get_ref());
        let update = health::NodeWatchResourcesResponse { devices: vec![device_health()] };
        Ok(Response::new(tokio_stream::iter(vec![Ok(update.clone()), Ok(update)])))
    }
}

type Grpc = tonic::client::Grpc<tonic::transport::Channel>;

async fn unary<Req, Resp>(grpc: &mut Grpc, path: &'static str, request: Req) -> Result<Resp, Status>
where
    Req: Message + Send + Sync + 'static,
    Resp: Message + Default + Send + Sync + 'static,
{
    grpc.ready().await.expect("the channel is ready");
    let codec = ProstCodec::<Req, Resp>::default();
    grpc.unary(Request::new(request), PathAndQuery::from_static(path), codec).await.map(Response::into_inner)
}

async fn streaming<Req, Resp>(grpc: &mut Grpc, path: &'static str, request: Req) -> Result<Vec<Resp>, Status>
where
    Req: Message + Send + Sync + 'static,
    Resp: Message + Default + Send + Sync + 'static,
{
    grpc.ready().await.expect("the channel is ready");
    let codec = ProstCodec::<Req, Resp>::default();
    let mut stream = grpc.server_streaming(Request::new(request), PathAndQuery::from_static(path), codec).await?.into_inner();
    let mut responses = Vec::new();
    while let Some(response) = stream.message().await? {
        responses.push(response);
    }
    Ok(responses)
}

/// The path of the upstream method named `method` (so that each call below uses `METHODS`).
fn path(method: &str) -> &'static str {
    let suffix = format!("/{method}");
    let mut found = METHODS.iter().filter(|(path, _)| path.ends_with(&suffix));
    let (path, _) = found.next().unwrap_or_else(|| panic!("no upstream method {method}"));
    assert!(found.next().is_none(), "two upstream methods named {method}");
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_method_paths_are_served() {
    let socket = std::env::temp_dir().join(format!("vramguard-proto-golden-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&socket);
    let listener = tokio::net::UnixListener::bind(&socket).expect("bind the test socket");
    let calls = Calls::default();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(registration::registration_server::RegistrationServer::new(calls.clone()))
            .add_service(v1::dra_plugin_server::DraPluginServer::new(calls.clone()))
            .add_service(health::dra_resource_health_server::DraResourceHealthServer::new(calls.clone()))
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
    );

    let checks = async {
        let channel = Endpoint::try_from(format!("unix://{}", socket.display())).expect("endpoint").connect().await.expect("connect");
        let mut grpc = Grpc::new(channel);
        let mut served = Vec::new();

        let info: registration::PluginInfo = unary(&mut grpc, path("GetInfo"), registration::InfoRequest {}).await.expect("GetInfo");
        assert_eq!(info.name, "served GetInfo");
        assert_eq!(calls.take(), [format!("GetInfo {:?}", registration::InfoRequest {})]);
        served.push(path("GetInfo"));

        let status = registration::RegistrationStatus { plugin_registered: true, error: "error".into() };
        let _: registration::RegistrationStatusResponse =
            unary(&mut grpc, path("NotifyRegistrationStatus"), status.clone()).await.expect("NotifyRegistrationStatus");
        assert_eq!(calls.take(), [format!("NotifyRegistrationStatus {status:?}")]);
        served.push(path("NotifyRegistrationStatus"));

        let claim = |uid: &str| v1::Claim { namespace: "namespace".into(), uid: uid.into(), name: "name".into() };
        let prepare = v1::NodePrepareResourcesRequest { claims: vec![claim("uid-a"), claim("uid-b")] };
        let prepared: v1::NodePrepareResourcesResponse =
            unary(&mut grpc, path("NodePrepareResources"), prepare.clone()).await.expect("NodePrepareResources");
        assert_eq!(prepared.claims, HashMap::from([("uid-a".into(), prepare_response()), ("uid-b".into(), prepare_response())]));
        assert_eq!(calls.take(), [format!("NodePrepareResources {prepare:?}")]);
        served.push(path("NodePrepareResources"));

        let unprepare = v1::NodeUnprepareResourcesRequest { claims: vec![claim("uid-a")] };
        let unprepared: v1::NodeUnprepareResourcesResponse =
            unary(&mut grpc, path("NodeUnprepareResources"), unprepare.clone()).await.expect("NodeUnprepareResources");
        assert_eq!(unprepared.claims, HashMap::from([("uid-a".into(), unprepare_response())]));
        assert_eq!(calls.take(), [format!("NodeUnprepareResources {unprepare:?}")]);
        served.push(path("NodeUnprepareResources"));

        let updates: Vec<health::NodeWatchResourcesResponse> =
            streaming(&mut grpc, path("NodeWatchResources"), health::NodeWatchResourcesRequest {}).await.expect("NodeWatchResources");
        assert_eq!(updates, vec![health::NodeWatchResourcesResponse { devices: vec![device_health()] }; 2]);
        assert_eq!(calls.take(), [format!("NodeWatchResources {:?}", health::NodeWatchResourcesRequest {})]);
        served.push(path("NodeWatchResources"));

        // Every upstream method was called, the streaming one as a stream.
        let streaming_paths: Vec<_> = METHODS.iter().filter(|(_, streams)| *streams).map(|(path, _)| *path).collect();
        assert_eq!(streaming_paths, [path("NodeWatchResources")]);
        served.sort_unstable();
        let mut upstream: Vec<_> = METHODS.iter().map(|(path, _)| *path).collect();
        upstream.sort_unstable();
        assert_eq!(served, upstream);

        // The control: paths upstream does not have are not served.
        for wrong in [
            "/pluginregistration.Registration/getInfo",
            "/pluginregistration.v1.Registration/GetInfo",
            "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResource",
            "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources",
            "/v1alpha1.DRAResourceHealth/WatchResources",
        ] {
            let error = unary::<registration::InfoRequest, registration::PluginInfo>(&mut grpc, wrong, registration::InfoRequest {})
                .await
                .expect_err(wrong);
            assert_eq!(error.code(), Code::Unimplemented, "{wrong}: {error}");
        }
        assert!(calls.take().is_empty(), "a wrong path reached an implementation");
    };
    let finished = tokio::time::timeout(Duration::from_secs(60), checks).await;
    server.abort();
    let _ = std::fs::remove_file(&socket);
    finished.expect("the calls finished within a minute");
}
