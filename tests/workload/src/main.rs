//! `fakecuda-workload`: drives the CUDA driver API from a list of steps, like a small
//! application would, and reports every result on stdout in a line format tests can parse.
//!
//! ```text
//! fakecuda-workload [--via dlsym|getproc] [--no-init] [--script FILE] [STEP]...
//! ```
//!
//! The driver is `dlopen("libcuda.so.1")`, so `LD_LIBRARY_PATH` picks the fake or the real one.
//! Output: `ready pid=N` first (after `cuInit`), `ok STEP NAME 0xPTR BYTES` for each
//! allocation or free, and one line per query step; stdout is flushed after every line. A CUDA
//! error prints `error STEP CODE NAME` on stderr and exits 1; a bad command line exits 2.
//! A child made by the `fork` step prefixes each of its lines (stdout and stderr) with `child `.
//! Steps are documented in [`steps`] and in `--help`. The `nvml-*` steps reach NVML
//! (`dlopen("libnvidia-ml.so.1")`, [`nvml`]), loaded and initialised by the first of them; an
//! NVML error prints `error STEP CODE TEXT` (NVML's code and description) and exits 1.

mod cuda;
mod nvml;
mod steps;

use std::collections::HashMap;
use std::ffi::c_int;
use std::io::{BufRead, Write};
use std::time::{Duration, Instant};

use cuda::*;
use steps::{GraphHow, Step};

const USAGE: &str = "\
usage: fakecuda-workload [--via dlsym|getproc] [--no-init] [--script FILE] [STEP]...


Each argument (or script line; # starts a comment) is one step. Sizes take k/m/g/t suffixes.
  ctx DEV                 cuDeviceGet + cuDevicePrimaryCtxRetain + cuCtxSetCurrent
  ctx-create DEV          cuCtxCreate_v2
  ctx-create-v3 DEV       cuCtxCreate_v3 (no affinity parameters)
  ctx-create-v4 DEV       cuCtxCreate_v4 (NULL parameters)
  ctx-destroy             undo the latest ctx/ctx-create* (release / destroy)
  alloc NAME SIZE         cuMemAlloc_v2
  pitch NAME W H ELEM     cuMemAllocPitch_v2
  managed NAME SIZE       cuMemAllocManaged (CU_MEM_ATTACH_GLOBAL)
  async[-ptsz] NAME SIZE  cuMemAllocAsync[_ptsz] on the NULL stream
  pool[-ptsz] NAME SIZE   cuDeviceGetMemPool + cuMemAllocFromPoolAsync[_ptsz]
  mempool POOL            cuMemPoolCreate on the current device; prints: ok mempool POOL 0xHANDLE 0
  mempool-alloc NAME SIZE POOL  cuMemAllocFromPoolAsync from POOL on the NULL stream
  mempool-destroy POOL    cuMemPoolDestroy
  create NAME SIZE        cuMemCreate on the current device
  create-host NAME SIZE   cuMemCreate of host memory (CU_MEM_LOCATION_TYPE_HOST)
  vmm NAME SIZE           cuMemCreate + cuMemAddressReserve + cuMemMap + cuMemSetAccess
  vmm-free NAME           cuMemUnmap + cuMemRelease + cuMemAddressFree
  unmap NAME              cuMemUnmap + cuMemAddressFree of a vmm mapping (the handle
                          stays unreleased: `release NAME` releases it)
  retain NAME             cuMemRetainAllocationHandle of a vmm mapping (one more reference:
                          `release NAME` drops it); prints: ok retain NAME 0xHANDLE
  array NAME W H D        cuArrayCreate_v2 (D = 0) or cuArray3DCreate_v2, float x 4 channels
  mipmap NAME W H D LEVELS  cuMipmappedArrayCreate, float x 4 channels
  array-destroy NAME      cuArrayDestroy
  import NAME SIZE        cuImportExternalMemory (opaque fd 0, SIZE bytes) + cuExternalMemoryGetMappedBuffer
  import-destroy NAME     cuDestroyExternalMemory
  mipmap-destroy NAME     cuMipmappedArrayDestroy
  graph NAME SIZE         cuGraphCreate + cuGraphAddMemAllocNode (SIZE on the current
                          device) + cuGraphInstantiateWithFlags
  graph-capture NAME SIZE cuMemAllocAsync + cuMemFreeAsync of SIZE captured from a new stream
                          (cuStreamBeginCapture_v2 .. cuStreamEndCapture) + cuGraphInstantiateWithParams
  graph-clone NAME SIZE   the `graph` graph cuGraphClone'd (original destroyed) + cuGraphInstantiateWithFlags
                          (drivers refuse to clone allocation nodes: CUDA_ERROR_NOT_SUPPORTED)
  graph-child NAME SIZE   a graph holding the `graph` graph in a child graph node (cuGraphAddNode_v2,
                          ownership moved) + cuGraphInstantiate_v2
  launch NAME             cuGraphLaunch of graph NAME on the NULL stream
  upload NAME             cuGraphUpload of graph NAME on the NULL stream
  graph-destroy NAME      cuGraphExecDestroy + cuGraphDestroy
  graph-trim              cuDeviceGraphMemTrim of the current device
  free NAME               cuMemFree_v2
  free-async[-ptsz] NAME  cuMemFreeAsync[_ptsz]
  release NAME            cuMemRelease
  trim BYTES              cuMemPoolTrimTo on the current device's default pool
  stream NAME             cuStreamCreate (flags 0); prints: ok stream NAME 0xHANDLE 0
  async-on NAME SIZE STREAM   cuMemAllocAsync on a `stream` stream
  free-async-on NAME STREAM   cuMemFreeAsync on a `stream` stream
  sync [STREAM]           cuStreamSynchronize (the NULL stream without STREAM); prints: sync STREAM|null
  event-sync [STREAM]     cuEventCreate + cuEventRecord (on STREAM, else the NULL stream) +
                          cuEventSynchronize + cuEventDestroy_v2; prints: event-sync STREAM|null
  ctx-sync                cuCtxSynchronize; prints: ctx-sync
  pool-threshold BYTES    cuMemPoolSetAttribute(CU_MEMPOOL_ATTR_RELEASE_THRESHOLD) of the
                          current device's default pool; prints: pool-threshold BYTES
  pool-stat               prints: pool-stat reserved=N used=N (cuMemPoolGetAttribute of the
                          current device's default pool)
  meminfo                 prints: meminfo free=N total=N
  devstat DEV             prints: devstat used=N total=N (fakecuda_device_usage)
  expect-oom STEP...      STEP must fail with CUDA_ERROR_OUT_OF_MEMORY; prints: oom NAME
  timed STEP...           runs STEP; prints: timed ns=N (its wall-clock duration)
  checkpoint NAME         prints: checkpoint NAME, then waits for a line (or EOF) on stdin
  sleep MS | hold | exit CODE | kill
  _exit CODE              _exit(2): no atexit handlers, no destructors
  fork-hold               fork; the child makes no CUDA call and sleeps until killed (it keeps
                          the parent's open files); prints: fork-hold child=PID
  leader-exit [PATH]      the main thread exits alone while another sleeps until the process
                          is killed (its leader a zombie in /proc, the process running on);
                          prints: leader-exit; the steps after it are not run; with PATH,
                          the other thread then maps PATH as `map` does; prints: map PATH
  stress THREADS PAIRS SIZE   prints: stress pairs=N
  race-free THREADS ROUNDS SIZE
                          each round cuMemAlloc_v2s SIZE, then THREADS threads cuMemFree_v2
                          that one pointer at once (a hostile double free);
                          prints: race-free rounds=N freed=M (frees the driver took)
  fill THREADS SIZE       each thread cuMemAlloc_v2s SIZE until refused (any error but
                          CUDA_ERROR_OUT_OF_MEMORY fails); keeps the allocations;
                          prints: fill allocations=N refusals=M
  free-fill               cuMemFree_v2 of everything fill holds; prints: free-fill frees=N
  meminfo-null            cuMemGetInfo_v2(NULL, &total) and (&free, NULL);
                          prints: meminfo-null null-free=CODE null-total=CODE
  fork STEP[; STEP]...    fork; the child runs cuInit, prints ready, runs the steps (its
                          lines prefixed `child `) and exits 0; the parent waits, then
                          prints: fork child=PID exit=CODE (or signal=SIG)
  bench PAIRS SIZE            prints: bench pairs=N ns_per_pair=X
  nvml-meminfo DEV [global]
                          nvmlDeviceGetHandleByIndex_v2 + nvmlDeviceGetMemoryInfo and _v2
                          (looked up on NVML's handle, or with `global` by
                          dlsym(RTLD_DEFAULT)); prints: nvml-meminfo total=N free=N used=N
                          v2-total=N v2-free=N v2-used=N v2-reserved=N
  nvml-procs DEV          nvmlDeviceGetComputeRunningProcesses_v3; prints one line a process:
                          nvml-proc pid=N used=N, then: nvml-procs count=N
  nvml-null DEV           both memory queries with a NULL struct, and _v2 with version 0;
                          prints: nvml-null v1=CODE v2=CODE v2-version=CODE
  nvml-uuid DEV           prints: nvml-uuid nvml=UUID cuda=UUID (nvmlDeviceGetUUID, and
                          cuDeviceGetUuid_v2 of ordinal DEV in the same GPU-... form)
  procaddr QUERY [EXPORT|-] [VERSION] [FLAGS]
                          prints: procaddr QUERY code=C status=S getproc=0xA dlsym=0xB
  dlsym SYMBOL...         prints: dlsym SYMBOL 0xADDR (0x0 if absent)
  calls SYMBOL...         prints: calls SYMBOL N (fakecuda_api_calls)
  map PATH                mmap PATH read+exec (as ld.so maps code) and keep it;
                          prints: map PATH
  map-many N PATH         mmap PATH's first page read-only N times (N lines of
                          /proc/self/maps) and keep them; prints: map-many N
  swap PATH PATH          exchange the two paths (renameat2 RENAME_EXCHANGE) forever;
                          prints: swap started";

/// A CUDA call that failed.
struct Failure {
    step: &'static str,
    code: CUresult,
}

type Res<T> = Result<T, Failure>;

/// What an allocating step produced.
#[derive(Clone, Copy)]
struct Named {
    /// Device pointer, or the handle for `create`.
    addr: u64,
    bytes: u64,
    /// For `vmm`: the physical handle.
    handle: u64,
}

struct Runner {
    drv: Driver,
    names: HashMap<String, Named>,
    /// Contexts made by ctx / ctx-create: (handle, device, primary).
    ctxs: Vec<(u64, CUdevice, bool)>,
    /// What `fill` allocated and `free-fill` has not freed yet.
    filled: Vec<CUdeviceptr>,
    /// NVML, once an `nvml-*` step loaded it.
    nvml: Option<nvml::Nvml>,
}

/// Set in a child made by the `fork` step: its output lines start with `child `.
static IN_CHILD: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn prefix() -> &'static str {
    if IN_CHILD.load(std::sync::atomic::Ordering::Relaxed) {
        "child "
    } else {
        ""
    }
}

fn say(line: std::fmt::Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    // A closed stdout (the test stopped reading) must not abort the workload.
    let _ = writeln!(out, "{}{line}", prefix());
    let _ = out.flush();
}

macro_rules! say {
    ($($t:tt)*) => { say(format_args!($($t)*)) };
}

/// Calls a driver entry point, mapping a missing one to CUDA_ERROR_NOT_FOUND.
macro_rules! cu {
    ($self:ident, $step:expr, $f:ident ( $($arg:expr),* )) => {{
        let f = $self.drv.fns.$f.ok_or(Failure { step: $step, code: CUDA_ERROR_NOT_FOUND })?;
        // SAFETY: the pointer came from the driver for this entry point; the arguments are
        // valid for its cuda.h signature (out-pointers point at locals of the right type).
        let rc = unsafe { f($($arg),*) };
        if rc != CUDA_SUCCESS {
            return Err(Failure { step: $step, code: rc });
        }
    }};
}

/// The parameters of an allocation node of `size` bytes on device `dev`.
fn alloc_node_params(dev: CUdevice, size: u64) -> CUDA_MEM_ALLOC_NODE_PARAMS {
    CUDA_MEM_ALLOC_NODE_PARAMS {
        pool_props: device_pool_props(dev),
        access_descs: std::ptr::null(),
        access_desc_count: 0,
        bytesize: size as usize,
        dptr: 0,
    }
}

/// A float4 3D array descriptor.
fn float4_3d(width: u64, height: u64, depth: u64) -> CUDA_ARRAY3D_DESCRIPTOR {
    CUDA_ARRAY3D_DESCRIPTOR {
        width: width as usize,
        height: height as usize,
        depth: depth as usize,
        format: CU_AD_FORMAT_FLOAT,
        num_channels: 4,
        flags: 0,
    }
}

/// Pool properties of pinned memory on device `dev`, without a size limit.
fn device_pool_props(dev: CUdevice) -> CUmemPoolProps {
    CUmemPoolProps {
        alloc_type: CU_MEM_ALLOCATION_TYPE_PINNED,
        handle_types: 0,
        location: CUmemLocation { type_: CU_MEM_LOCATION_TYPE_DEVICE, id: dev },
        win32_security_attributes: null(),
        max_size: 0,
        usage: 0,
        reserved: [0; 54],
    }
}

fn null() -> *mut std::ffi::c_void {
    std::ptr::null_mut()
}

impl Runner {
    fn named(&self, name: &str) -> Result<Named, String> {
        self.names.get(name).copied().ok_or_else(|| format!("no allocation named {name:?}"))
    }

    fn current_device(&self, step: &'static str) -> Res<CUdevice> {
        let mut dev: CUdevice = 0;
        cu!(self, step, ctx_get_device(&mut dev));
        Ok(dev)
    }

    fn default_pool(&self, step: &'static str) -> Res<CUmemoryPool> {
        let dev = self.current_device(step)?;
        let mut pool: CUmemoryPool = null();
        cu!(self, step, device_get_mem_pool(&mut pool, dev));
        Ok(pool)
    }

    /// NVML, loaded and initialised on first use; a failure to do so ends the workload.
    fn nvml(&mut self, verb: &str) -> &nvml::Nvml {
        if self.nvml.is_none() {
            match nvml::Nvml::load() {
                Ok(n) => self.nvml = Some(n),
                Err(e) => {
                    let _ = std::io::stdout().flush();
                    eprintln!("{}error {verb} {e}", prefix());
                    std::process::exit(1);
                }
            }
        }
        match &self.nvml {
            Some(n) => n,
            None => std::process::exit(1), // unreachable: just loaded
        }
    }

    /// Reports an NVML error and ends the workload.
    fn nvml_fail(&self, verb: &str, e: nvml::NvmlError) -> ! {
        let _ = std::io::stdout().flush();
        let text = self.nvml.as_ref().map(|n| n.error_text(e.code)).unwrap_or_default();
        eprintln!("{}error {verb} {} {text} ({})", prefix(), e.code, e.call);
        std::process::exit(1);
    }

    fn record(&mut self, step: &Step, addr: u64, bytes: u64, handle: u64) {
        let name = step.name().unwrap_or("?").to_string();
        say!("ok {} {} {:#x} {}", step.verb(), name, addr, bytes);
        self.names.insert(name, Named { addr, bytes, handle });
    }

    /// Runs one step. `Err(Ok(failure))` is a CUDA error, `Err(Err(text))` a usage error.
    fn run(&mut self, step: &Step) -> Result<(), Result<Failure, String>> {
        let verb = step.verb();
        let usage = |e: String| Err(e);
        match step {
            Step::Ctx(dev) => {
                let mut d: CUdevice = 0;
                let mut ctx: CUcontext = null();
                self.call(|s| {
                    cu!(s, verb, device_get(&mut d, *dev));
                    cu!(s, verb, primary_retain(&mut ctx, d));
                    cu!(s, verb, ctx_set_current(ctx));
                    Ok(())
                })?;
                self.ctxs.push((ctx as u64, d, true));
                say!("ctx dev={} handle={:#x}", d, ctx as u64);
            }
            Step::CtxCreate(dev) => {
                let mut d: CUdevice = 0;
                let mut ctx: CUcontext = null();
                self.call(|s| {
                    cu!(s, verb, device_get(&mut d, *dev));
                    cu!(s, verb, ctx_create(&mut ctx, 0, d));
                    Ok(())
                })?;
                self.ctxs.push((ctx as u64, d, false));
                say!("ctx-create dev={} handle={:#x}", d, ctx as u64);
            }
            Step::CtxCreateV { dev, version } => {
                let mut d: CUdevice = 0;
                let mut ctx: CUcontext = null();
                self.call(|s| {
                    cu!(s, verb, device_get(&mut d, *dev));
                    if *version == 3 {
                        cu!(s, verb, ctx_create_v3(&mut ctx, null(), 0, 0, d));
                    } else {
                        cu!(s, verb, ctx_create_v4(&mut ctx, std::ptr::null_mut(), 0, d));
                    }
                    Ok(())
                })?;
                self.ctxs.push((ctx as u64, d, false));
                say!("{verb} dev={} handle={:#x}", d, ctx as u64);
            }
            Step::CtxDestroy => {
                let Some(&(h, dev, primary)) = self.ctxs.last() else {
                    return Err(usage("ctx-destroy: no context made by ctx or ctx-create".into()));
                };
                self.call(|s| {
                    if primary {
                        cu!(s, verb, primary_release(dev));
                    } else {
                        cu!(s, verb, ctx_destroy(h as CUcontext));
                    }
                    Ok(())
                })?;
                self.ctxs.pop();
                let next = self.ctxs.last().map(|c| c.0).unwrap_or(0);
                self.call(|s| {
                    cu!(s, verb, ctx_set_current(next as CUcontext));
                    Ok(())
                })?;
                say!("ctx-destroy handle={:#x}", h);
            }
            Step::Alloc { size, .. } => {
                let mut p: CUdeviceptr = 0;
                self.call(|s| {
                    cu!(s, verb, mem_alloc(&mut p, *size as usize));
                    Ok(())
                })?;
                self.record(step, p, *size, 0);
            }
            Step::Pitch { width, height, elem, .. } => {
                let (mut p, mut pitch): (CUdeviceptr, usize) = (0, 0);
                self.call(|s| {
                    cu!(s, verb, mem_alloc_pitch(&mut p, &mut pitch, *width as usize, *height as usize, *elem));
                    Ok(())
                })?;
                self.record(step, p, pitch as u64 * height, 0);
            }
            Step::Managed { size, .. } => {
                let mut p: CUdeviceptr = 0;
                self.call(|s| {
                    cu!(s, verb, mem_alloc_managed(&mut p, *size as usize, CU_MEM_ATTACH_GLOBAL));
                    Ok(())
                })?;
                self.record(step, p, *size, 0);
            }
            Step::Async { size, ptsz, .. } => {
                let mut p: CUdeviceptr = 0;
                self.call(|s| {
                    if *ptsz {
                        cu!(s, verb, mem_alloc_async_ptsz(&mut p, *size as usize, null()));
                    } else {
                        cu!(s, verb, mem_alloc_async(&mut p, *size as usize, null()));
                    }
                    Ok(())
                })?;
                self.record(step, p, *size, 0);
            }
            Step::Pool { size, ptsz, .. } => {
                let mut p: CUdeviceptr = 0;
                self.call(|s| {
                    let pool = s.default_pool(verb)?;
                    if *ptsz {
                        cu!(s, verb, mem_alloc_from_pool_ptsz(&mut p, *size as usize, pool, null()));
                    } else {
                        cu!(s, verb, mem_alloc_from_pool(&mut p, *size as usize, pool, null()));
                    }
                    Ok(())
                })?;
                self.record(step, p, *size, 0);
            }
            Step::MemPool { .. } => {
                let mut pool: CUmemoryPool = null();
                self.call(|s| {
                    let dev = s.current_device(verb)?;
                    let props = device_pool_props(dev);
                    cu!(s, verb, mem_pool_create(&mut pool, &props));
                    Ok(())
                })?;
                self.record(step, pool as u64, 0, pool as u64);
            }
            Step::MemPoolAlloc { size, pool, .. } => {
                let pool = self.named(pool).map_err(Err)?.handle as CUmemoryPool;
                let mut p: CUdeviceptr = 0;
                self.call(|s| {
                    cu!(s, verb, mem_alloc_from_pool(&mut p, *size as usize, pool, null()));
                    Ok(())
                })?;
                self.record(step, p, *size, 0);
            }
            Step::MemPoolDestroy { name } => {
                let n = self.named(name).map_err(Err)?;
                self.call(|s| {
                    cu!(s, verb, mem_pool_destroy(n.handle as CUmemoryPool));
                    Ok(())
                })?;
                say!("ok {verb} {name} {:#x} 0", n.handle);
            }
            Step::Create { size, .. } => {
                let mut h: CUmemGenericAllocationHandle = 0;
                self.call(|s| {
                    let prop = s.device_prop(verb)?;
                    cu!(s, verb, mem_create(&mut h, *size as usize, &prop, 0));
                    Ok(())
                })?;
                self.record(step, h, *size, h);
            }
            Step::Vmm { size, .. } => {
                let (mut h, mut p): (CUmemGenericAllocationHandle, CUdeviceptr) = (0, 0);
                self.call(|s| {
                    let prop = s.device_prop(verb)?;
                    cu!(s, verb, mem_create(&mut h, *size as usize, &prop, 0));
                    cu!(s, verb, mem_address_reserve(&mut p, *size as usize, 0, 0, 0));
                    cu!(s, verb, mem_map(p, *size as usize, 0, h, 0));
                    let access = CUmemAccessDesc { location: prop.location, flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
                    cu!(s, verb, mem_set_access(p, *size as usize, &access, 1));
                    Ok(())
                })?;
                self.record(step, p, *size, h);
            }
            Step::CreateHost { size, .. } => {
                let mut h: CUmemGenericAllocationHandle = 0;
                self.call(|s| {
                    let mut prop = s.device_prop(verb)?;
                    prop.location = CUmemLocation { type_: CU_MEM_LOCATION_TYPE_HOST, id: 0 };
                    cu!(s, verb, mem_create(&mut h, *size as usize, &prop, 0));
                    Ok(())
                })?;
                self.record(step, h, *size, h);
            }
            Step::Retain { name } => {
                let n = self.named(name).map_err(Err)?;
                let mut h: CUmemGenericAllocationHandle = 0;
                self.call(|s| {
                    cu!(s, verb, mem_retain_allocation_handle(&mut h, n.addr as *mut std::ffi::c_void));
                    Ok(())
                })?;
                say!("ok {verb} {name} {h:#x}");
            }
            Step::Array { width, height, depth, .. } => {
                let mut a: CUarray = null();
                self.call(|s| {
                    if *depth == 0 {
                        let desc = CUDA_ARRAY_DESCRIPTOR { width: *width as usize, height: *height as usize, format: CU_AD_FORMAT_FLOAT, num_channels: 4 };
                        cu!(s, verb, array_create(&mut a, &desc));
                    } else {
                        let desc = float4_3d(*width, *height, *depth);
                        cu!(s, verb, array_3d_create(&mut a, &desc));
                    }
                    Ok(())
                })?;
                self.record(step, a as u64, width * height.max(&1) * depth.max(&1) * 16, 0);
            }
            Step::Mipmap { width, height, depth, levels, .. } => {
                let mut m: CUmipmappedArray = null();
                self.call(|s| {
                    cu!(s, verb, mipmapped_array_create(&mut m, &float4_3d(*width, *height, *depth), *levels));
                    Ok(())
                })?;
                self.record(step, m as u64, width * height.max(&1) * depth.max(&1) * 16, 0);
            }
            Step::ArrayDestroy { name }
            | Step::MipmapDestroy { name }
            | Step::Launch { name }
            | Step::Upload { name }
            | Step::GraphDestroy { name } => {
                let n = self.named(name).map_err(Err)?;
                let handle = n.addr as *mut std::ffi::c_void;
                self.call(|s| {
                    match step {
                        Step::ArrayDestroy { .. } => cu!(s, verb, array_destroy(handle)),
                        Step::MipmapDestroy { .. } => cu!(s, verb, mipmapped_array_destroy(handle)),
                        Step::Launch { .. } => cu!(s, verb, graph_launch(handle, null())),
                        Step::Upload { .. } => cu!(s, verb, graph_upload(handle, null())),
                        _ => {
                            cu!(s, verb, graph_exec_destroy(handle));
                            cu!(s, verb, graph_destroy(n.handle as *mut std::ffi::c_void));
                        }
                    }
                    Ok(())
                })?;
                say!("ok {verb} {name} {:#x} {}", n.addr, n.bytes);
            }
            Step::Import { size, .. } => {
                let mut ext: CUexternalMemory = null();
                let mut dptr: CUdeviceptr = 0;
                self.call(|s| {
                    let desc = CUDA_EXTERNAL_MEMORY_HANDLE_DESCRIPTOR {
                        type_: CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD,
                        handle: CUexternalMemoryHandle { fd: 0 },
                        size: *size,
                        flags: 0,
                        reserved: [0; 16],
                    };
                    cu!(s, verb, import_external_memory(&mut ext, &desc));
                    let buffer = CUDA_EXTERNAL_MEMORY_BUFFER_DESC { offset: 0, size: *size, ..Default::default() };
                    cu!(s, verb, external_memory_get_mapped_buffer(&mut dptr, ext, &buffer));
                    Ok(())
                })?;
                self.record(step, ext as u64, *size, dptr);
            }
            Step::ImportDestroy { name } => {
                let n = self.named(name).map_err(Err)?;
                self.call(|s| {
                    cu!(s, verb, destroy_external_memory(n.addr as CUexternalMemory));
                    Ok(())
                })?;
                say!("ok {verb} {name} {:#x} {}", n.addr, n.bytes);
            }
            Step::Graph { size, how, .. } => {
                let (mut graph, mut exec): (CUgraph, CUgraphExec) = (null(), null());
                let mut dptr: CUdeviceptr = 0;
                self.call(|s| {
                    let dev = s.current_device(verb)?;
                    // One allocation node in a new graph (the `graph`, `graph-clone` and
                    // `graph-child` steps start from it).
                    let alloc_graph = |graph: &mut CUgraph, dptr: &mut CUdeviceptr| {
                        let mut node: CUgraphNode = null();
                        cu!(s, verb, graph_create(graph, 0));
                        let mut params = alloc_node_params(dev, *size);
                        cu!(s, verb, graph_add_mem_alloc_node(&mut node, *graph, std::ptr::null(), 0, &mut params));
                        *dptr = params.dptr;
                        Ok(())
                    };
                    match how {
                        GraphHow::Nodes => {
                            alloc_graph(&mut graph, &mut dptr)?;
                            cu!(s, verb, graph_instantiate_with_flags(&mut exec, graph, 0));
                        }
                        GraphHow::Clone => {
                            let mut original: CUgraph = null();
                            alloc_graph(&mut original, &mut dptr)?;
                            cu!(s, verb, graph_clone(&mut graph, original));
                            cu!(s, verb, graph_destroy(original));
                            cu!(s, verb, graph_instantiate_with_flags(&mut exec, graph, 0));
                        }
                        GraphHow::Child => {
                            let (mut child, mut node): (CUgraph, CUgraphNode) = (null(), null());
                            alloc_graph(&mut child, &mut dptr)?;
                            cu!(s, verb, graph_create(&mut graph, 0));
                            // Moved, not cloned: a graph with allocation nodes cannot be cloned.
                            let mut params = CUgraphNodeParams { type_: CU_GRAPH_NODE_TYPE_GRAPH, reserved0: [0; 3], params: [0; 29], reserved2: 0 };
                            let moved = CUDA_CHILD_GRAPH_NODE_PARAMS { graph: child, ownership: CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE };
                            // SAFETY: the union's first bytes hold the child graph parameters (16 of 232 bytes, 8-aligned).
                            unsafe { params.params.as_mut_ptr().cast::<CUDA_CHILD_GRAPH_NODE_PARAMS>().write(moved) };
                            cu!(s, verb, graph_add_node_v2(&mut node, graph, std::ptr::null(), std::ptr::null(), 0, &mut params));
                            cu!(s, verb, graph_instantiate_v2(&mut exec, graph, std::ptr::null_mut(), std::ptr::null_mut(), 0));
                        }
                        GraphHow::Capture => {
                            let mut stream: CUstream = null();
                            cu!(s, verb, stream_create(&mut stream, 1));
                            cu!(s, verb, stream_begin_capture(stream, CU_STREAM_CAPTURE_MODE_GLOBAL));
                            cu!(s, verb, mem_alloc_async(&mut dptr, *size as usize, stream));
                            cu!(s, verb, mem_free_async(dptr, stream));
                            cu!(s, verb, stream_end_capture(stream, &mut graph));
                            cu!(s, verb, stream_destroy(stream));
                            let mut params = CUDA_GRAPH_INSTANTIATE_PARAMS {
                                flags: 0,
                                h_upload_stream: null(),
                                h_err_node_out: null(),
                                result_out: 0,
                            };
                            cu!(s, verb, graph_instantiate_with_params(&mut exec, graph, &mut params));
                        }
                    }
                    Ok(())
                })?;
                say!("graph {} dptr={dptr:#x}", step.name().unwrap_or("?"));
                self.record(step, exec as u64, *size, graph as u64);
            }
            Step::GraphTrim => {
                self.call(|s| {
                    let dev = s.current_device(verb)?;
                    cu!(s, verb, device_graph_mem_trim(dev));
                    Ok(())
                })?;
                say!("graph-trim");
            }
            Step::VmmFree { name } => {
                let n = self.named(name).map_err(Err)?;
                self.call(|s| {
                    cu!(s, verb, mem_unmap(n.addr, n.bytes as usize));
                    cu!(s, verb, mem_release(n.handle));
                    cu!(s, verb, mem_address_free(n.addr, n.bytes as usize));
                    Ok(())
                })?;
                say!("ok {verb} {name} {:#x} {}", n.addr, n.bytes);
            }
            Step::Unmap { name } => {
                let n = self.named(name).map_err(Err)?;
                self.call(|s| {
                    cu!(s, verb, mem_unmap(n.addr, n.bytes as usize));
                    cu!(s, verb, mem_address_free(n.addr, n.bytes as usize));
                    Ok(())
                })?;
                say!("ok {verb} {name} {:#x} {}", n.addr, n.bytes);
            }
            Step::Free { name } | Step::FreeAsync { name, .. } | Step::Release { name } => {
                // A freed name keeps its entry, so freeing it again really double-frees.
                let n = self.named(name).map_err(Err)?;
                self.call(|s| {
                    match step {
                        Step::Free { .. } => cu!(s, verb, mem_free(n.addr)),
                        Step::FreeAsync { ptsz: false, .. } => cu!(s, verb, mem_free_async(n.addr, null())),
                        Step::FreeAsync { ptsz: true, .. } => cu!(s, verb, mem_free_async_ptsz(n.addr, null())),
                        _ => cu!(s, verb, mem_release(n.handle)),
                    }
                    Ok(())
                })?;
                say!("ok {verb} {name} {:#x} {}", n.addr, n.bytes);
            }
            Step::Stream { .. } => {
                let mut stream: CUstream = null();
                self.call(|s| {
                    cu!(s, verb, stream_create(&mut stream, 0));
                    Ok(())
                })?;
                self.record(step, stream as u64, 0, stream as u64);
            }
            Step::AsyncOn { size, stream, .. } => {
                let stream = self.named(stream).map_err(Err)?.handle as CUstream;
                let mut p: CUdeviceptr = 0;
                self.call(|s| {
                    cu!(s, verb, mem_alloc_async(&mut p, *size as usize, stream));
                    Ok(())
                })?;
                self.record(step, p, *size, 0);
            }
            Step::FreeAsyncOn { name, stream } => {
                let n = self.named(name).map_err(Err)?;
                let stream = self.named(stream).map_err(Err)?.handle as CUstream;
                self.call(|s| {
                    cu!(s, verb, mem_free_async(n.addr, stream));
                    Ok(())
                })?;
                say!("ok {verb} {name} {:#x} {}", n.addr, n.bytes);
            }
            Step::Sync(stream) | Step::EventSync(stream) => {
                let handle = match stream {
                    Some(name) => self.named(name).map_err(Err)?.handle as CUstream,
                    None => null(),
                };
                self.call(|s| {
                    if matches!(step, Step::Sync(_)) {
                        cu!(s, verb, stream_synchronize(handle));
                    } else {
                        let mut event: CUevent = null();
                        cu!(s, verb, event_create(&mut event, 0));
                        cu!(s, verb, event_record(event, handle));
                        cu!(s, verb, event_synchronize(event));
                        cu!(s, verb, event_destroy(event));
                    }
                    Ok(())
                })?;
                say!("{verb} {}", stream.as_deref().unwrap_or("null"));
            }
            Step::CtxSync => {
                self.call(|s| {
                    cu!(s, verb, ctx_synchronize());
                    Ok(())
                })?;
                say!("{verb}");
            }
            Step::PoolThreshold(bytes) => {
                self.call(|s| {
                    let pool = s.default_pool(verb)?;
                    let mut value: u64 = *bytes;
                    cu!(s, verb, mem_pool_set_attribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, (&mut value as *mut u64).cast()));
                    Ok(())
                })?;
                say!("{verb} {bytes}");
            }
            Step::PoolStat => {
                let (mut reserved, mut used) = (0u64, 0u64);
                self.call(|s| {
                    let pool = s.default_pool(verb)?;
                    cu!(s, verb, mem_pool_get_attribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, (&mut reserved as *mut u64).cast()));
                    cu!(s, verb, mem_pool_get_attribute(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, (&mut used as *mut u64).cast()));
                    Ok(())
                })?;
                say!("{verb} reserved={reserved} used={used}");
            }
            Step::NvmlProcs(dev) => {
                let processes = match self.nvml(verb).processes(*dev) {
                    Ok(processes) => processes,
                    Err(e) => self.nvml_fail(verb, e),
                };
                for (pid, used) in &processes {
                    say!("nvml-proc pid={pid} used={used}");
                }
                say!("{verb} count={}", processes.len());
            }
            Step::Trim(keep) => {
                self.call(|s| {
                    let pool = s.default_pool(verb)?;
                    cu!(s, verb, mem_pool_trim_to(pool, *keep as usize));
                    Ok(())
                })?;
                say!("trim {keep}");
            }
            Step::Meminfo => {
                let (mut free, mut total) = (0usize, 0usize);
                self.call(|s| {
                    cu!(s, verb, mem_get_info(&mut free, &mut total));
                    Ok(())
                })?;
                say!("meminfo free={free} total={total}");
            }
            Step::Devstat(dev) => {
                type Usage = unsafe extern "C" fn(c_int, *mut u64, *mut u64) -> CUresult;
                let sym = self.drv.dlsym("fakecuda_device_usage");
                if sym.is_null() {
                    return Err(Ok(Failure { step: verb, code: CUDA_ERROR_NOT_FOUND }));
                }
                // SAFETY: the fake exports fakecuda_device_usage with exactly this signature.
                let f = unsafe { std::mem::transmute::<*mut std::ffi::c_void, Usage>(sym) };
                let (mut used, mut total) = (0u64, 0u64);
                // SAFETY: valid out-pointers.
                let rc = unsafe { f(*dev, &mut used, &mut total) };
                if rc != CUDA_SUCCESS {
                    return Err(Ok(Failure { step: verb, code: rc }));
                }
                say!("devstat used={used} total={total}");
            }
            Step::ExpectOom(inner) => match self.run(inner) {
                Err(Ok(f)) if f.code == CUDA_ERROR_OUT_OF_MEMORY => {
                    say!("oom {}", inner.name().unwrap_or(inner.verb()));
                }
                Err(e) => return Err(e),
                Ok(()) => return Err(Ok(Failure { step: verb, code: CUDA_SUCCESS })),
            },
            Step::Timed(inner) => {
                let start = std::time::Instant::now();
                self.run(inner)?;
                say!("timed ns={}", start.elapsed().as_nanos());
            }
            Step::Checkpoint(name) => {
                say!("checkpoint {name}");
                let mut line = String::new();
                let _ = std::io::stdin().lock().read_line(&mut line);
            }
            Step::Sleep(ms) => std::thread::sleep(Duration::from_millis(*ms)),
            Step::Stress { threads, pairs, size } => {
                let mut ctx: CUcontext = null();
                self.call(|s| {
                    cu!(s, verb, ctx_get_current(&mut ctx));
                    Ok(())
                })?;
                let ctx = ctx as u64;
                let this = &*self;
                let result: Res<()> = std::thread::scope(|scope| {
                    let workers: Vec<_> = (0..*threads)
                        .map(|_| scope.spawn(move || this.pairs(verb, ctx, *pairs, *size)))
                        .collect();
                    workers
                        .into_iter()
                        .try_for_each(|w| w.join().unwrap_or(Err(Failure { step: verb, code: -1 })))
                });
                result.map_err(Ok)?;
                say!("stress pairs={}", u64::from(*threads) * pairs);
            }
            Step::RaceFree { threads, rounds, size } => {
                let mut ctx: CUcontext = null();
                self.call(|s| {
                    cu!(s, verb, ctx_get_current(&mut ctx));
                    Ok(())
                })?;
                let freed = self.race_frees(verb, ctx as u64, *threads, *rounds, *size).map_err(Ok)?;
                say!("race-free rounds={rounds} freed={freed}");
            }
            Step::Fill { threads, size } => {
                let mut ctx: CUcontext = null();
                self.call(|s| {
                    cu!(s, verb, ctx_get_current(&mut ctx));
                    Ok(())
                })?;
                let ctx = ctx as u64;
                let this = &*self;
                let filled: Res<Vec<Vec<CUdeviceptr>>> = std::thread::scope(|scope| {
                    let workers: Vec<_> = (0..*threads)
                        .map(|_| scope.spawn(move || this.fill(verb, ctx, *size)))
                        .collect();
                    workers
                        .into_iter()
                        .map(|w| w.join().unwrap_or(Err(Failure { step: verb, code: -1 })))
                        .collect()
                });
                let filled = filled.map_err(Ok)?;
                let allocations: usize = filled.iter().map(Vec::len).sum();
                self.filled.extend(filled.into_iter().flatten());
                // Each thread stops at its first refusal.
                say!("fill allocations={allocations} refusals={threads}");
            }
            Step::FreeFill => {
                let mut frees = 0u64;
                while let Some(&p) = self.filled.last() {
                    self.call(|s| {
                        cu!(s, verb, mem_free(p));
                        Ok(())
                    })?;
                    self.filled.pop();
                    frees += 1;
                }
                say!("free-fill frees={frees}");
            }
            Step::MeminfoNull => {
                let f = self.drv.fns.mem_get_info.ok_or(Ok(Failure { step: verb, code: CUDA_ERROR_NOT_FOUND }))?;
                let (mut free, mut total) = (0usize, 0usize);
                // SAFETY: cuMemGetInfo_v2 with one NULL out-pointer and one valid one: the
                // driver must answer a NULL with an error code, never write through it.
                let (null_free, null_total) =
                    unsafe { (f(std::ptr::null_mut(), &mut total), f(&mut free, std::ptr::null_mut())) };
                say!("meminfo-null null-free={null_free} null-total={null_total}");
            }
            Step::NvmlMeminfo { dev, global } => match self.nvml(verb).meminfo(*dev, *global) {
                Ok(nvml::Meminfo { v1, v2 }) => say!(
                    "nvml-meminfo total={} free={} used={} v2-total={} v2-free={} v2-used={} v2-reserved={}",
                    v1.total,
                    v1.free,
                    v1.used,
                    v2.total,
                    v2.free,
                    v2.used,
                    v2.reserved
                ),
                Err(e) => self.nvml_fail(verb, e),
            },
            Step::NvmlNull(dev) => match self.nvml(verb).null_codes(*dev) {
                Ok((v1, v2, version)) => say!("nvml-null v1={v1} v2={v2} v2-version={version}"),
                Err(e) => self.nvml_fail(verb, e),
            },
            Step::NvmlUuid(dev) => {
                let text = match self.nvml(verb).uuid(*dev) {
                    Ok(text) => text,
                    Err(e) => self.nvml_fail(verb, e),
                };
                let ordinal = CUdevice::try_from(*dev).map_err(|_| Err(format!("device {dev} out of range")))?;
                let mut uuid = CUuuid { bytes: [0; 16] };
                self.call(|s| {
                    cu!(s, verb, device_get_uuid(&mut uuid, ordinal));
                    Ok(())
                })?;
                say!("nvml-uuid nvml={text} cuda={}", gpu_uuid_text(&uuid.bytes.map(|b| b as u8)));
            }
            Step::Fork(steps) => {
                let _ = std::io::stdout().flush();
                // SAFETY: fork(2); no other thread of this process runs at this point (steps
                // join the threads they start), so the child inherits no held lock.
                let pid = unsafe { libc::fork() };
                if pid < 0 {
                    return Err(Err(format!("fork: {}", std::io::Error::last_os_error())));
                }
                if pid == 0 {
                    self.run_child(steps);
                }
                let mut status: c_int = 0;
                // SAFETY: waits for our own child, with a valid out-pointer.
                let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
                if waited != pid {
                    return Err(Err(format!("waitpid({pid}): {}", std::io::Error::last_os_error())));
                }
                if libc::WIFEXITED(status) {
                    say!("fork child={pid} exit={}", libc::WEXITSTATUS(status));
                } else {
                    say!("fork child={pid} signal={}", libc::WTERMSIG(status));
                }
            }
            Step::Bench { pairs, size } => {
                let start = Instant::now();
                self.pairs(verb, 0, *pairs, *size).map_err(Ok)?;
                let ns = start.elapsed().as_nanos() as f64 / (*pairs).max(1) as f64;
                say!("bench pairs={pairs} ns_per_pair={ns:.1}");
            }
            Step::Map(path) => {
                map_exec(path).map_err(Err)?;
                say!("map {path}");
            }
            Step::MapMany(count, path) => {
                map_many(*count, path).map_err(Err)?;
                say!("map-many {count}");
            }
            Step::Swap(a, b) => {
                say!("swap started");
                swap_forever(a, b).map_err(Err)?;
            }
            Step::Hold => loop {
                std::thread::sleep(Duration::from_secs(3600));
            },
            Step::Exit(code) => {
                let _ = std::io::stdout().flush();
                std::process::exit(*code);
            }
            Step::RawExit(code) => {
                let _ = std::io::stdout().flush();
                // SAFETY: _exit(2) ends the process at once; nothing runs after it.
                unsafe { libc::_exit(*code) }
            }
            Step::ForkHold => {
                let _ = std::io::stdout().flush();
                // SAFETY: fork(2); no other thread of this process runs at this point (steps
                // join the threads they start). The child only sleeps (async-signal-safe).
                let pid = unsafe { libc::fork() };
                if pid < 0 {
                    return Err(Err(format!("fork: {}", std::io::Error::last_os_error())));
                }
                if pid == 0 {
                    // SAFETY: open(2) and dup2(2) of a static path (async-signal-safe): the
                    // child lets go of the test's stdout and stderr pipes, so the test sees
                    // them end when the parent does.
                    unsafe {
                        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
                        if null >= 0 {
                            libc::dup2(null, 1);
                            libc::dup2(null, 2);
                        }
                    }
                    loop {
                        // SAFETY: pause(2) waits for a signal; the default action of the
                        // test's SIGKILL or SIGTERM ends the child.
                        unsafe { libc::pause() };
                    }
                }
                say!("fork-hold child={pid}");
            }
            Step::LeaderExit(path) => {
                let path = path.clone();
                let pid = std::process::id();
                std::thread::spawn(move || {
                    if let Some(path) = path {
                        // Once the leader is a zombie: its /proc/<pid>/maps is empty then.
                        while !std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with('Z'))) {
                            std::thread::sleep(Duration::from_millis(5));
                        }
                        match map_exec(&path) {
                            Ok(()) => say!("map {path}"),
                            Err(error) => eprintln!("error map {error}"),
                        }
                        let _ = std::io::stdout().flush();
                    }
                    loop {
                        std::thread::sleep(Duration::from_secs(3600));
                    }
                });
                say!("leader-exit");
                let _ = std::io::stdout().flush();
                // SAFETY: exit(2) (not exit_group) ends the calling thread alone, at once,
                // without unwinding: nothing of this thread is used after it, and the
                // sleeping thread touches nothing of it.
                unsafe { libc::syscall(libc::SYS_exit, 0) };
                unreachable!("exit(2) returned");
            }
            Step::Kill(stamp) => {
                let _ = std::io::stdout().flush();
                if let Some(path) = stamp {
                    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
                    // SAFETY: writes the clock's value into `now`, a valid timespec.
                    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
                    let ns = now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64;
                    std::fs::write(path, ns.to_string()).map_err(|e| Err(format!("kill: cannot write {path}: {e}")))?;
                }
                // SAFETY: sends SIGKILL to this process; nothing is borrowed across it.
                unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
                loop {
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
            Step::Procaddr { query, export, version, flags } => {
                let (addr, code, status) = match self.drv.getproc(query, *version, *flags) {
                    Ok(p) => (p as u64, CUDA_SUCCESS, 0),
                    Err((code, status)) => (0, code, status),
                };
                let exported = export.as_deref().map(|e| self.drv.dlsym(e) as u64).unwrap_or(0);
                say!("procaddr {query} code={code} status={status} getproc={addr:#x} dlsym={exported:#x}");
            }
            Step::Dlsym(names) => {
                for n in names {
                    say!("dlsym {n} {:#x}", self.drv.dlsym(n) as u64);
                }
            }
            Step::Calls(names) => {
                type Calls = unsafe extern "C" fn(*const std::ffi::c_char) -> u64;
                let sym = self.drv.dlsym("fakecuda_api_calls");
                if sym.is_null() {
                    return Err(Ok(Failure { step: verb, code: CUDA_ERROR_NOT_FOUND }));
                }
                // SAFETY: the fake exports fakecuda_api_calls with exactly this signature.
                let f = unsafe { std::mem::transmute::<*mut std::ffi::c_void, Calls>(sym) };
                for n in names {
                    let c = std::ffi::CString::new(n.as_str()).map_err(|_| Err(format!("bad symbol {n:?}")))?;
                    // SAFETY: a NUL-terminated string.
                    say!("calls {n} {}", unsafe { f(c.as_ptr()) });
                }
            }
        }
        Ok(())
    }

    /// Runs CUDA calls, mapping their failure to the step error type.
    fn call(&self, f: impl FnOnce(&Self) -> Res<()>) -> Result<(), Result<Failure, String>> {
        f(self).map_err(Ok)
    }

    fn device_prop(&self, step: &'static str) -> Res<CUmemAllocationProp> {
        let dev = self.current_device(step)?;
        Ok(CUmemAllocationProp {
            type_: CU_MEM_ALLOCATION_TYPE_PINNED,
            requested_handle_types: 0,
            location: CUmemLocation { type_: CU_MEM_LOCATION_TYPE_DEVICE, id: dev },
            win32_handle_meta_data: null(),
            alloc_flags: CUmemAllocFlags::default(),
        })
    }

    /// cuMemAlloc_v2 of `size` on this thread (after making `ctx` current, unless it is 0)
    /// until the driver refuses with CUDA_ERROR_OUT_OF_MEMORY; returns what it allocated.
    /// Any other error fails.
    fn fill(&self, step: &'static str, ctx: u64, size: u64) -> Res<Vec<CUdeviceptr>> {
        if ctx != 0 {
            cu!(self, step, ctx_set_current(ctx as CUcontext));
        }
        let alloc = self.drv.fns.mem_alloc.ok_or(Failure { step, code: CUDA_ERROR_NOT_FOUND })?;
        let mut held = Vec::new();
        loop {
            let mut p: CUdeviceptr = 0;
            // SAFETY: cuMemAlloc_v2 with a valid out-pointer.
            match unsafe { alloc(&mut p, size as usize) } {
                CUDA_SUCCESS => held.push(p),
                CUDA_ERROR_OUT_OF_MEMORY => return Ok(held),
                code => return Err(Failure { step, code }),
            }
        }
    }

    /// The child side of `fork`: a fresh driver (`cuInit`), no allocations of the parent's,
    /// the steps, exit 0. Never returns.
    fn run_child(&mut self, steps: &[Step]) -> ! {
        IN_CHILD.store(true, std::sync::atomic::Ordering::Relaxed);
        self.names.clear();
        self.ctxs.clear();
        self.filled.clear();
        let init = self.call(|s| {
            cu!(s, "init", init(0));
            Ok(())
        });
        if let Err(Ok(f)) = init {
            fail(self, f);
        }
        say!("ready pid={}", std::process::id());
        for step in steps {
            match self.run(step) {
                Ok(()) => {}
                Err(Ok(f)) => fail(self, f),
                Err(Err(e)) => {
                    eprintln!("{}fakecuda-workload: {e}", prefix());
                    std::process::exit(2);
                }
            }
        }
        let _ = std::io::stdout().flush();
        std::process::exit(0);
    }

    /// `pairs` cuMemAlloc_v2/cuMemFree_v2 pairs on this thread (after making `ctx` current,
    /// unless it is 0).
    /// `rounds` allocations, each freed by `threads` threads at once; how many frees the
    /// driver took.
    fn race_frees(&self, step: &'static str, ctx: u64, threads: u32, rounds: u64, size: u64) -> Res<u64> {
        use std::sync::atomic::{AtomicU64, Ordering};
        use std::sync::Barrier;
        let free = self.drv.fns.mem_free.ok_or(Failure { step, code: CUDA_ERROR_NOT_FOUND })?;
        let (target, freed) = (AtomicU64::new(0), AtomicU64::new(0));
        let barrier = Barrier::new(threads as usize + 1);
        let this = self;
        std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    scope.spawn(|| {
                        let mut ready = Ok(());
                        if ctx != 0 {
                            ready = (|| {
                                cu!(this, step, ctx_set_current(ctx as CUcontext));
                                Ok(())
                            })();
                        }
                        for _ in 0..rounds {
                            barrier.wait();
                            let p = target.load(Ordering::SeqCst);
                            // SAFETY: the driver's cuMemFree_v2, given a pointer value (the
                            // driver refuses one it does not know).
                            if ready.is_ok() && p != 0 && unsafe { free(p) } == CUDA_SUCCESS {
                                freed.fetch_add(1, Ordering::SeqCst);
                            }
                            barrier.wait();
                        }
                        ready
                    })
                })
                .collect();
            // Every round runs its barriers even after a failure, so no worker waits forever.
            let mut outcome = Ok(());
            for _ in 0..rounds {
                let mut p: CUdeviceptr = 0;
                if outcome.is_ok() {
                    outcome = (|| {
                        cu!(this, step, mem_alloc(&mut p, size as usize));
                        Ok(())
                    })();
                }
                target.store(p, Ordering::SeqCst);
                barrier.wait();
                barrier.wait();
            }
            for worker in workers {
                let joined = worker.join().unwrap_or(Err(Failure { step, code: -1 }));
                outcome = outcome.and(joined);
            }
            outcome
        })?;
        Ok(freed.load(Ordering::SeqCst))
    }

    fn pairs(&self, step: &'static str, ctx: u64, pairs: u64, size: u64) -> Res<()> {
        if ctx != 0 {
            cu!(self, step, ctx_set_current(ctx as CUcontext));
        }
        for _ in 0..pairs {
            let mut p: CUdeviceptr = 0;
            cu!(self, step, mem_alloc(&mut p, size as usize));
            cu!(self, step, mem_free(p));
        }
        Ok(())
    }
}

struct Options {
    via: Via,
    init: bool,
    steps: Vec<Step>,
}

fn parse_args() -> Result<Options, String> {
    let mut via = Via::Dlsym;
    let mut init = true;
    let mut steps = Vec::new();
    let mut args = std::env::args().skip(1);
    let mut only_steps = false;
    while let Some(arg) = args.next() {
        if only_steps || !arg.starts_with("--") {
            steps.push(Step::parse(&arg).map_err(|e| e.to_string())?);
            continue;
        }
        let (key, inline) = match arg.split_once('=') {
            Some((k, v)) => (k.to_string(), Some(v.to_string())),
            None => (arg.clone(), None),
        };
        let mut value = |name: &str| inline.clone().or_else(|| args.next()).ok_or(format!("{name} needs a value"));
        match key.as_str() {
            "--via" => {
                via = match value("--via")?.as_str() {
                    "dlsym" => Via::Dlsym,
                    "getproc" => Via::Getproc,
                    other => return Err(format!("--via {other:?}: expected dlsym or getproc")),
                }
            }
            "--script" => {
                let path = value("--script")?;
                let text = std::fs::read_to_string(&path).map_err(|e| format!("--script {path}: {e}"))?;
                steps.extend(Step::parse_script(&text).map_err(|e| format!("--script {path}: {e}"))?);
            }
            "--no-init" => init = false,
            "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            "--" => only_steps = true,
            other => return Err(format!("unknown option {other:?}")),
        }
    }
    Ok(Options { via, init, steps })
}

fn main() {
    let opts = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("fakecuda-workload: {e}\n{USAGE}");
            std::process::exit(2);
        }
    };
    let drv = match Driver::load(opts.via) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("fakecuda-workload: {e}");
            std::process::exit(1);
        }
    };
    let mut runner = Runner { drv, names: HashMap::new(), ctxs: Vec::new(), filled: Vec::new(), nvml: None };
    if opts.init {
        let init = runner.call(|s| {
            cu!(s, "init", init(0));
            Ok(())
        });
        if let Err(Ok(f)) = init {
            fail(&runner, f);
        }
    }
    say!("ready pid={}", std::process::id());
    for step in &opts.steps {
        match runner.run(step) {
            Ok(()) => {}
            Err(Ok(f)) => fail(&runner, f),
            Err(Err(e)) => {
                eprintln!("fakecuda-workload: {e}");
                std::process::exit(2);
            }
        }
    }
}

fn fail(runner: &Runner, f: Failure) -> ! {
    let _ = std::io::stdout().flush();
    let name = runner.drv.error_name(f.code);
    eprintln!("{}error {} {} {}", prefix(), f.step, f.code, name);
    std::process::exit(1);
}

/// Maps all of `path` readable and executable, privately, and leaves it mapped.
fn map_exec(path: &str) -> Result<(), String> {
    let file = std::fs::File::open(path).map_err(|e| format!("map: cannot open {path}: {e}"))?;
    let len = file.metadata().map_err(|e| format!("map: {path}: {e}"))?.len().max(1) as usize;
    // SAFETY: a new private mapping of an open file; the kernel picks the address and the
    // mapping is never unmapped, so no Rust reference is invalidated.
    let address = unsafe {
        libc::mmap(null(), len, libc::PROT_READ | libc::PROT_EXEC, libc::MAP_PRIVATE, std::os::fd::AsRawFd::as_raw_fd(&file), 0)
    };
    if address == libc::MAP_FAILED {
        return Err(format!("map: mmap {path}: {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Maps the first page of `path` read-only `count` times and leaves the mappings. Each maps
/// file offset 0, so no two can merge into one mapping, wherever the kernel puts them.
fn map_many(count: u64, path: &str) -> Result<(), String> {
    let file = std::fs::File::open(path).map_err(|e| format!("map-many: cannot open {path}: {e}"))?;
    for done in 0..count {
        // SAFETY: a new private read-only mapping of an open file; the kernel picks the
        // address and the mapping is never unmapped, so no Rust reference is invalidated.
        let address = unsafe { libc::mmap(null(), 4096, libc::PROT_READ, libc::MAP_PRIVATE, std::os::fd::AsRawFd::as_raw_fd(&file), 0) };
        if address == libc::MAP_FAILED {
            return Err(format!("map-many: mmap {path} (after {done}): {}", std::io::Error::last_os_error()));
        }
    }
    Ok(())
}

/// Exchanges paths `a` and `b` in a loop that never ends (the process is killed).
fn swap_forever(a: &str, b: &str) -> Result<(), String> {
    let c = |p: &str| std::ffi::CString::new(p).map_err(|_| format!("swap: {p:?} has a NUL byte"));
    let (a, b) = (c(a)?, c(b)?);
    loop {
        // SAFETY: two valid NUL-terminated paths; renameat2 reads them only.
        let rc = unsafe { libc::renameat2(libc::AT_FDCWD, a.as_ptr(), libc::AT_FDCWD, b.as_ptr(), libc::RENAME_EXCHANGE) };
        if rc != 0 {
            return Err(format!("swap: renameat2: {}", std::io::Error::last_os_error()));
        }
        // Each state lasts a moment: long enough to be seen, short enough to race.
        std::thread::sleep(Duration::from_micros(50));
    }
}
