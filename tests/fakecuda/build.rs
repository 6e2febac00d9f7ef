//! Gives the fake driver the soname of the real one, so that a program linked against
//! `libcuda.so.1` (or a dlopen of that name through a symlink) finds this library.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
    println!("cargo:rerun-if-changed=build.rs");
}
