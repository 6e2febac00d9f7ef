//! Embeds the eBPF object built by `cargo xtask build-ebpf` into the agent binary, and
//! generates the DRA kubelet plugin's gRPC messages, servers and clients from `proto/*.proto`
//! (compiled by protox, in Rust: no protoc).
use std::{env, fs, path::PathBuf};

/// The kubelet's plugin protocols (see `src/dra/proto.rs`).
const PROTOS: [&str; 3] = ["proto/pluginregistration.proto", "proto/dra_v1.proto", "proto/dra_health_v1alpha1.proto"];

fn main() {
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let object = manifest.join("../ebpf/target/bpfel-unknown-none/release/vramguard");
    println!("cargo:rerun-if-changed={}", object.display());
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("vramguard.bpf.o");
    if let Err(error) = fs::copy(&object, &out) {
        panic!(
            "the eBPF object {} is missing ({error}): run `cargo xtask build-ebpf` first \
             (`cargo xtask setup` installs what it needs)",
            object.display()
        );
    }

    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    let descriptors = protox::compile(PROTOS, ["proto"]).unwrap_or_else(|error| panic!("the DRA protocol files do not compile: {error}"));
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptors)
        .unwrap_or_else(|error| panic!("cannot generate the DRA gRPC code: {error}"));
}
