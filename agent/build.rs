//! Embeds the eBPF object built by `cargo xtask build-ebpf` into the agent binary.
use std::{env, fs, path::PathBuf};

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
}
