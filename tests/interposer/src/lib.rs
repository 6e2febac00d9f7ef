//! `libinterposer.so`: a library that wraps another's function the usual way, preloaded beside
//! the hook in the tests of a preload that breaks nothing. Its `getpid` counts the call and
//! calls the next definition, found with `dlsym(RTLD_NEXT, "getpid")`; if that lookup hands
//! back this very wrapper (what a `dlsym` interposer that resolves `RTLD_NEXT` relative to
//! itself does), it says so and exits 97 instead of recursing until the stack overflows.
//! `interposer_next(name)` is `dlsym(RTLD_NEXT, name)` called from this library.
use std::{
    ffi::{c_char, c_void},
    sync::atomic::{AtomicU64, AtomicUsize, Ordering},
};

static CALLS: AtomicU64 = AtomicU64::new(0);
static NEXT: AtomicUsize = AtomicUsize::new(0);

/// `getpid`, counted.
#[no_mangle]
pub extern "C" fn getpid() -> libc::pid_t {
    CALLS.fetch_add(1, Ordering::Relaxed);
    let mut next = NEXT.load(Ordering::Acquire);
    if next == 0 {
        // SAFETY: a NUL-terminated name; dlsym returns null or the address of `getpid`.
        next = unsafe { libc::dlsym(libc::RTLD_NEXT, c"getpid".as_ptr()) } as usize;
        if next == 0 || next == getpid as *const () as usize {
            let message = b"interposer: dlsym(RTLD_NEXT, \"getpid\") returned this wrapper itself (or nothing)\n";
            // SAFETY: writes a static buffer to stderr, then ends the process.
            unsafe {
                libc::write(libc::STDERR_FILENO, message.as_ptr().cast(), message.len());
                libc::_exit(97);
            }
        }
        NEXT.store(next, Ordering::Release);
    }
    // SAFETY: `next` is the next definition of getpid, whose signature this is.
    let next: extern "C" fn() -> libc::pid_t = unsafe { std::mem::transmute::<usize, extern "C" fn() -> libc::pid_t>(next) };
    next()
}

/// How often this library's `getpid` was called.
#[no_mangle]
pub extern "C" fn interposer_getpid_calls() -> u64 {
    CALLS.load(Ordering::Relaxed)
}

/// `dlsym(RTLD_NEXT, name)`, called from this library.
///
/// # Safety
/// `name` is a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn interposer_next(name: *const c_char) -> *mut c_void {
    // SAFETY: per the contract.
    let found = unsafe { libc::dlsym(libc::RTLD_NEXT, name) };
    // Not a tail call: glibc must see this library as the caller.
    std::hint::black_box(found)
}
