//! `preload-probe`: what a program that is not about CUDA sees of the preloaded libraries, for
//! the tests of a preload that breaks nothing (tests/e2e/tests/preload.rs). One command:
//!
//! ```text
//! preload-probe getpid                 prints: getpid same=0|1 wrapped=N
//! preload-probe lookups                prints: lookup WHAT -> OBJECT:SYMBOL (one per lookup),
//!                                      then: libcuda loaded=0|1
//! preload-probe cuda                   dlopen("libcuda.so.1"), then prints: libcuda loaded=0|1,
//!                                      and `cuda WHAT=OBJECT:SYMBOL` for dlsym(RTLD_DEFAULT),
//!                                      dlsym and dlvsym on libcuda's handle, and (if it is
//!                                      loaded) the interposer's dlsym(RTLD_NEXT), of
//!                                      cuMemAlloc_v2
//! preload-probe fork THREADS FORKS     see `fork` below
//! ```
//!
//! OBJECT is the file name of the object dladdr names (`-` for a null result). The
//! interposer's functions are looked up with dlsym(RTLD_DEFAULT) (absent: counted as 0).
use std::{
    ffi::{c_char, c_int, c_uint, c_void, CStr, CString},
    io::Write,
    sync::atomic::{AtomicBool, AtomicU64, Ordering},
    time::{Duration, Instant},
};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    match args.as_slice() {
        ["getpid"] => getpid(),
        ["lookups"] => lookups(),
        ["cuda"] => cuda(),
        ["fork", threads, forks] => fork(threads.parse().expect("THREADS"), forks.parse().expect("FORKS")),
        _ => {
            eprintln!("usage: preload-probe getpid | lookups | cuda | fork THREADS FORKS");
            std::process::exit(2);
        }
    }
}

fn global(name: &CStr) -> *mut c_void {
    // SAFETY: a NUL-terminated name.
    unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) }
}

fn getpid() {
    // SAFETY: plain calls; the first goes through the preloaded libraries, the second not.
    let (through, raw) = unsafe { (libc::getpid(), libc::syscall(libc::SYS_getpid) as libc::pid_t) };
    let calls = global(c"interposer_getpid_calls");
    let wrapped = if calls.is_null() {
        0
    } else {
        // SAFETY: the interposer's counter, `extern "C" fn() -> u64`.
        unsafe { std::mem::transmute::<*mut c_void, extern "C" fn() -> u64>(calls)() }
    };
    println!("getpid same={} wrapped={wrapped}", u8::from(through == raw));
}

/// `OBJECT:SYMBOL` of an address, by dladdr.
fn describe(address: *mut c_void) -> String {
    if address.is_null() {
        return "-".into();
    }
    // SAFETY: dladdr only reads the loader's tables; the strings it returns live while the
    // object is loaded.
    unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        if libc::dladdr(address, &mut info) == 0 || info.dli_fname.is_null() {
            return format!("?:{address:p}");
        }
        let file = CStr::from_ptr(info.dli_fname).to_string_lossy();
        let file = file.rsplit('/').next().unwrap_or_default().to_string();
        let symbol = if info.dli_sname.is_null() { "?".into() } else { CStr::from_ptr(info.dli_sname).to_string_lossy().into_owned() };
        format!("{file}:{symbol}")
    }
}

fn libcuda_loaded() -> bool {
    std::fs::read_to_string("/proc/self/maps").expect("read /proc/self/maps").contains("libcuda")
}

/// The interposer's `dlsym(RTLD_NEXT, name)` from inside it, if it is loaded.
fn interposer_next(name: &CStr) -> Option<*mut c_void> {
    let next = global(c"interposer_next");
    // SAFETY: the interposer's `unsafe extern "C" fn(*const c_char) -> *mut c_void`.
    (!next.is_null()).then(|| unsafe {
        std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*const c_char) -> *mut c_void>(next)(name.as_ptr())
    })
}

fn lookups() {
    // SAFETY: NUL-terminated names and versions; the handles are the special ones or libc's.
    unsafe {
        let libc_handle = libc::dlopen(c"libc.so.6".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        let cases: [(&str, *mut c_void); 11] = [
            ("dlsym(RTLD_NEXT,getpid)", libc::dlsym(libc::RTLD_NEXT, c"getpid".as_ptr())),
            ("dlsym(RTLD_DEFAULT,getpid)", libc::dlsym(libc::RTLD_DEFAULT, c"getpid".as_ptr())),
            ("dlsym(RTLD_NEXT,printf)", libc::dlsym(libc::RTLD_NEXT, c"printf".as_ptr())),
            ("dlsym(RTLD_DEFAULT,cuserid)", libc::dlsym(libc::RTLD_DEFAULT, c"cuserid".as_ptr())),
            ("dlsym(RTLD_NEXT,cuserid)", libc::dlsym(libc::RTLD_NEXT, c"cuserid".as_ptr())),
            ("dlsym(libc,cuserid)", libc::dlsym(libc_handle, c"cuserid".as_ptr())),
            ("dlvsym(RTLD_DEFAULT,cuserid,GLIBC_2.2.5)", libc::dlvsym(libc::RTLD_DEFAULT, c"cuserid".as_ptr(), c"GLIBC_2.2.5".as_ptr())),
            ("dlvsym(RTLD_NEXT,realpath,GLIBC_2.2.5)", libc::dlvsym(libc::RTLD_NEXT, c"realpath".as_ptr(), c"GLIBC_2.2.5".as_ptr())),
            ("dlsym(RTLD_DEFAULT,cuNoSuchEntryPoint)", libc::dlsym(libc::RTLD_DEFAULT, c"cuNoSuchEntryPoint".as_ptr())),
            ("dlsym(RTLD_DEFAULT,cuMemAlloc_v2)", libc::dlsym(libc::RTLD_DEFAULT, c"cuMemAlloc_v2".as_ptr())),
            ("dlsym(RTLD_DEFAULT,nvmlDeviceGetMemoryInfo)", libc::dlsym(libc::RTLD_DEFAULT, c"nvmlDeviceGetMemoryInfo".as_ptr())),
        ];
        for (what, found) in cases {
            println!("lookup {what} -> {}", describe(found));
        }
        let missing = libc::dlsym(libc::RTLD_DEFAULT, c"noSuchSymbolAnywhere".as_ptr());
        let error = libc::dlerror();
        println!("lookup dlsym(RTLD_DEFAULT,noSuchSymbolAnywhere) -> {} dlerror={}", describe(missing), u8::from(!error.is_null()));
        for name in [c"getpid", c"cuserid"] {
            if let Some(found) = interposer_next(name) {
                println!("lookup interposer:dlsym(RTLD_NEXT,{}) -> {}", name.to_string_lossy(), describe(found));
            }
        }
    }
    println!("libcuda loaded={}", u8::from(libcuda_loaded()));
}

fn cuda() {
    // SAFETY: loading the driver runs its initialisers, as any CUDA program does; the other
    // calls are lookups with NUL-terminated names.
    unsafe {
        let handle = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
        assert!(!handle.is_null(), "dlopen libcuda.so.1 failed");
        println!("libcuda loaded={}", u8::from(libcuda_loaded()));
        let hooks = global(c"cuMemAlloc_v2");
        let by_handle = libc::dlsym(handle, c"cuMemAlloc_v2".as_ptr());
        let versioned = libc::dlvsym(handle, c"cuMemAlloc_v2".as_ptr(), c"GLIBC_2.2.5".as_ptr());
        let next = interposer_next(c"cuMemAlloc_v2");
        println!("cuda wrapper={}", describe(hooks));
        println!("cuda dlsym(libcuda)={}", describe(by_handle));
        println!("cuda dlvsym(libcuda,GLIBC_2.2.5)={}", describe(versioned));
        if let Some(next) = next {
            println!("cuda interposer:dlsym(RTLD_NEXT)={}", describe(next));
        }
    }
}

// ---- fork -------------------------------------------------------------------------------------

type CuInit = unsafe extern "C" fn(c_uint) -> c_int;
type CuDeviceGet = unsafe extern "C" fn(*mut c_int, c_int) -> c_int;
type CuRetain = unsafe extern "C" fn(*mut *mut c_void, c_int) -> c_int;
type CuSetCurrent = unsafe extern "C" fn(*mut c_void) -> c_int;
type CuAlloc = unsafe extern "C" fn(*mut u64, usize) -> c_int;
type CuFree = unsafe extern "C" fn(u64) -> c_int;

struct Cuda {
    init: CuInit,
    device_get: CuDeviceGet,
    retain: CuRetain,
    set_current: CuSetCurrent,
    alloc: CuAlloc,
    free: CuFree,
}

fn lookup<T: Copy>(handle: *mut c_void, name: &str) -> T {
    let c = CString::new(name).expect("name");
    // SAFETY: a live handle and a NUL-terminated name.
    let found = unsafe { libc::dlsym(handle, c.as_ptr()) };
    assert!(!found.is_null(), "libcuda has no {name}");
    assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: T is the function pointer type of that entry point (cuda.h).
    unsafe { std::mem::transmute_copy::<*mut c_void, T>(&found) }
}

fn load_cuda() -> Cuda {
    // SAFETY: loading the driver, as any CUDA program does.
    let handle = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW) };
    assert!(!handle.is_null(), "dlopen libcuda.so.1 failed");
    Cuda {
        init: lookup(handle, "cuInit"),
        device_get: lookup(handle, "cuDeviceGet"),
        retain: lookup(handle, "cuDevicePrimaryCtxRetain"),
        set_current: lookup(handle, "cuCtxSetCurrent"),
        alloc: lookup(handle, "cuMemAlloc_v2"),
        free: lookup(handle, "cuMemFree_v2"),
    }
}

/// Whether a thread of this process waits for a `flock` (a line `->` ... `FLOCK` ... naming
/// this pid in /proc/locks).
fn waiting_for_flock() -> bool {
    let pid = std::process::id().to_string();
    let locks = std::fs::read_to_string("/proc/locks").unwrap_or_default();
    locks.lines().any(|l| l.contains("->") && l.contains("FLOCK") && l.split_whitespace().any(|w| w == pid))
}

/// In a child: what a forked program that does not use CUDA itself touches of the hook (its
/// symbol lookups; with `driver`, also a driver call whose hook sets this process's mode up),
/// then `exit(0)`. (The fake driver itself is not fork-safe: a child only calls it while no
/// thread of the parent can be inside it.)
fn child(cuda: &Cuda, driver: bool) -> ! {
    // SAFETY: lookups with NUL-terminated names; cuMemFree_v2(0) is a valid call (the driver
    // refuses it: not initialised in this process).
    unsafe {
        libc::dlsym(libc::RTLD_DEFAULT, c"cuMemAlloc_v2".as_ptr());
        libc::dlsym(libc::RTLD_NEXT, c"cuserid".as_ptr());
        libc::getpid();
        if driver {
            (cuda.free)(0);
        }
        libc::exit(0)
    }
}

/// Forks `forks` children one after the other, each run by [`child`] (`driver`: calling the
/// driver too); waits for each at most
/// `limit`, killing it if it does not exit. Returns (exited 0, hung).
fn fork_children(cuda: &Cuda, driver: bool, forks: u32, limit: Duration) -> (u32, u32) {
    let (mut exited, mut hung) = (0, 0);
    for _ in 0..forks {
        // SAFETY: the child only calls the functions in `child` and exits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            child(cuda, driver);
        }
        let start = Instant::now();
        loop {
            let mut status = 0;
            // SAFETY: our own child.
            let done = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
            if done == pid {
                if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0 {
                    exited += 1;
                }
                break;
            }
            if start.elapsed() > limit {
                hung += 1;
                // SAFETY: our own child, then reaped.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                    libc::waitpid(pid, &mut status, 0);
                }
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    (exited, hung)
}

/// Threads set up CUDA (the hook's set-up of this process) and allocate, while the main thread
/// forks. The test holds the ledger's creation lock, so the first thread's set-up waits for
/// it, holding the hook's set-up turn, while the others wait for that turn: phase 1 forks then
/// (once /proc/locks shows the wait; its children call the driver through the hook, which sets
/// their mode up), prints `phase1 exited=N hung=H`, then `checkpoint` and waits for a line on
/// stdin (the test lets the set-up go on). Phase 2 forks while the threads allocate and free
/// (its children only look symbols up); then `phase2 exited=N hung=H`, `allocations ok=N refused=R`.
fn fork(threads: u32, forks: u32) {
    let limit = Duration::from_secs(std::env::var("PROBE_CHILD_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(10));
    let cuda: &'static Cuda = Box::leak(Box::new(load_cuda()));
    // SAFETY: cuInit(0) is the driver's first call (not one the hook sets up on).
    assert_eq!(unsafe { (cuda.init)(0) }, 0, "cuInit");
    static STOP: AtomicBool = AtomicBool::new(false);
    static OK: AtomicU64 = AtomicU64::new(0);
    static REFUSED: AtomicU64 = AtomicU64::new(0);
    let workers: Vec<_> = (0..threads)
        .map(|_| {
            std::thread::spawn(move || {
                // SAFETY: the driver's calls with live out-pointers; each pointer allocated
                // here is freed here.
                unsafe {
                    let mut device = 0;
                    assert_eq!((cuda.device_get)(&mut device, 0), 0, "cuDeviceGet");
                    let mut ctx = std::ptr::null_mut();
                    assert_eq!((cuda.retain)(&mut ctx, device), 0, "cuDevicePrimaryCtxRetain");
                    assert_eq!((cuda.set_current)(ctx), 0, "cuCtxSetCurrent");
                    while !STOP.load(Ordering::Relaxed) {
                        let mut pointer = 0;
                        match (cuda.alloc)(&mut pointer, 1 << 20) {
                            0 => {
                                OK.fetch_add(1, Ordering::Relaxed);
                                (cuda.free)(pointer);
                            }
                            _ => {
                                REFUSED.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                }
            })
        })
        .collect();
    while !waiting_for_flock() {
        std::thread::sleep(Duration::from_millis(1));
    }
    let (exited, hung) = fork_children(cuda, true, forks, limit);
    println!("phase1 exited={exited} hung={hung}");
    println!("checkpoint");
    std::io::stdout().flush().expect("flush");
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).expect("stdin");
    while OK.load(Ordering::Relaxed) == 0 && REFUSED.load(Ordering::Relaxed) == 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    let (exited, hung) = fork_children(cuda, false, forks, limit);
    println!("phase2 exited={exited} hung={hung}");
    STOP.store(true, Ordering::Relaxed);
    for worker in workers {
        worker.join().expect("worker");
    }
    println!("allocations ok={} refused={}", OK.load(Ordering::Relaxed), REFUSED.load(Ordering::Relaxed));
}
