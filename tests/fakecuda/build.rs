//! Gives the fake driver the soname of the real one, so that a program linked against
//! `libcuda.so.1` (or a dlopen of that name through a symlink) finds this library, and binds
//! its references to its own functions inside itself, as the real driver's are: the addresses
//! `cuGetProcAddress` hands out are the library's own even when a preloaded library exports
//! the same names (so a hook must substitute them itself, as it must with the real driver).

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-Bsymbolic-functions");
    println!("cargo:rerun-if-changed=build.rs");
}
