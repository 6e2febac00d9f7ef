//! The step language of `fakecuda-workload`: one step per command-line argument or script
//! line, words separated by blanks, sizes with optional k/m/g/t suffixes (1024-based, parsed
//! by [`cuda_abi::parse_size`]).

use std::fmt;

use cuda_abi::parse_size;

/// How a `graph` step builds and instantiates its graph (one allocation node of the step's
/// size on the current device, however it got there).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GraphHow {
    /// `graph`: `cuGraphCreate` + `cuGraphAddMemAllocNode` + `cuGraphInstantiateWithFlags`.
    Nodes,
    /// `graph-capture`: `cuMemAllocAsync` + `cuMemFreeAsync` captured from a new stream
    /// (`cuStreamBeginCapture_v2` ... `cuStreamEndCapture`) + `cuGraphInstantiateWithParams`.
    Capture,
    /// `graph-clone`: the `graph` graph, `cuGraphClone`d (the original destroyed) +
    /// `cuGraphInstantiateWithFlags`. Drivers refuse to clone allocation nodes
    /// (`CUDA_ERROR_NOT_SUPPORTED`).
    Clone,
    /// `graph-child`: a graph holding the `graph` graph in a child graph node
    /// (`cuGraphAddNode_v2`, `CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE`) + `cuGraphInstantiate_v2`
    /// (the legacy export).
    Child,
}

/// One step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    Ctx(i32),
    CtxCreate(i32),
    /// `cuCtxCreate_v3` (version 3) or `_v4` (version 4), without affinity or CIG parameters.
    CtxCreateV { dev: i32, version: u8 },
    CtxDestroy,
    Alloc { name: String, size: u64 },
    Pitch { name: String, width: u64, height: u64, elem: u32 },
    Managed { name: String, size: u64 },
    Async { name: String, size: u64, ptsz: bool },
    Pool { name: String, size: u64, ptsz: bool },
    /// `cuStreamCreate` (flags 0) of a stream named `name`.
    Stream { name: String },
    /// `cuMemAllocAsync` on a stream made by `stream`.
    AsyncOn { name: String, size: u64, stream: String },
    /// `cuMemFreeAsync` on a stream made by `stream`.
    FreeAsyncOn { name: String, stream: String },
    /// `cuStreamSynchronize` of a `stream` stream (`None`: the NULL stream).
    Sync(Option<String>),
    /// `cuEventCreate` + `cuEventRecord` on a `stream` stream (`None`: the NULL stream) +
    /// `cuEventSynchronize` + `cuEventDestroy_v2`.
    EventSync(Option<String>),
    /// `cuCtxSynchronize`.
    CtxSync,
    /// `cuMemPoolSetAttribute(CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)` of the current device's
    /// default pool.
    PoolThreshold(u64),
    /// The current device's default pool's reserved and used memory (`cuMemPoolGetAttribute`).
    PoolStat,
    /// NVML's running compute processes of a device, with their used memory.
    NvmlProcs(u32),
    /// `cuMemPoolCreate` of a pool on the current device (pinned, no size limit).
    MemPool { name: String },
    /// `cuMemAllocFromPoolAsync` from a pool made by `mempool`, on the NULL stream.
    MemPoolAlloc { name: String, size: u64, pool: String },
    /// `cuMemPoolDestroy` of a pool made by `mempool`.
    MemPoolDestroy { name: String },
    Create { name: String, size: u64 },
    /// `cuMemCreate` of host-located memory (`CU_MEM_LOCATION_TYPE_HOST`).
    CreateHost { name: String, size: u64 },
    /// `cuMemRetainAllocationHandle` of a `vmm` mapping.
    Retain { name: String },
    /// A float4 array: `cuArrayCreate_v2` (depth 0) or `cuArray3DCreate_v2`.
    Array { name: String, width: u64, height: u64, depth: u64 },
    /// A float4 `cuMipmappedArrayCreate`.
    Mipmap { name: String, width: u64, height: u64, depth: u64, levels: u32 },
    ArrayDestroy { name: String },
    MipmapDestroy { name: String },
    /// A graph allocating `size` bytes on the current device, built and instantiated as
    /// [`GraphHow`] says.
    Graph { name: String, size: u64, how: GraphHow },
    Launch { name: String },
    /// `cuGraphUpload` of an executable graph.
    Upload { name: String },
    GraphDestroy { name: String },
    GraphTrim,
    /// `cuImportExternalMemory` of an opaque fd (the workload's stdin) of this size, then
    /// `cuExternalMemoryGetMappedBuffer` of all of it.
    Import { name: String, size: u64 },
    /// `cuDestroyExternalMemory`.
    ImportDestroy { name: String },
    Vmm { name: String, size: u64 },
    VmmFree { name: String },
    /// `cuMemUnmap` + `cuMemAddressFree` of a `vmm` mapping; its handle is not released.
    Unmap { name: String },
    Free { name: String },
    FreeAsync { name: String, ptsz: bool },
    Release { name: String },
    Trim(u64),
    Meminfo,
    Devstat(i32),
    ExpectOom(Box<Step>),
    Timed(Box<Step>),
    Checkpoint(String),
    Sleep(u64),
    Stress { threads: u32, pairs: u64, size: u64 },
    RaceFree { threads: u32, rounds: u64, size: u64 },
    Bench { pairs: u64, size: u64 },
    Hold,
    Exit(i32),
    /// `_exit(CODE)`: no atexit handlers, no destructors (what a crashing or `os._exit`ing
    /// parent does).
    RawExit(i32),
    /// `fork`; the child makes no CUDA call and sleeps until killed (a forked worker that
    /// keeps the parent's open device files).
    ForkHold,
    /// The main thread exits alone (`exit(2)`, not `exit_group`) while another thread sleeps
    /// until the process is killed: the process runs on, holding its memory, while
    /// `/proc/<pid>/stat` shows its leader a zombie. With a path, that thread maps the file
    /// read+exec once the leader is a zombie (as `map`).
    LeaderExit(Option<String>),
    /// `kill(getpid(), SIGKILL)`. With a path, `CLOCK_MONOTONIC` in ns is written to it first
    /// (the moment of the exit, for whoever measures from it: a file, so that no reader of
    /// the workload's output is woken between the reading and the kill).
    Kill(Option<String>),
    Procaddr { query: String, export: Option<String>, version: i32, flags: u64 },
    Dlsym(Vec<String>),
    Calls(Vec<String>),
    Fill { threads: u32, size: u64 },
    FreeFill,
    MeminfoNull,
    Fork(Vec<Step>),
    NvmlMeminfo { dev: u32, global: bool },
    NvmlNull(u32),
    NvmlUuid(u32),
    /// Maps a file executable (as the dynamic loader maps a library's code) and keeps it.
    Map(String),
    /// Maps the first page of a file read-only this many times (each its own mapping: one
    /// line of `/proc/self/maps` each) and keeps them.
    MapMany(u64, String),
    /// Exchanges two paths (`renameat2(RENAME_EXCHANGE)`) over and over, forever.
    Swap(String, String),
}

/// A step that could not be parsed.
#[derive(Debug)]
pub struct ParseError(pub String);

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn parse_int(text: &str) -> Option<i64> {
    match text.strip_prefix("0x") {
        Some(hex) => i64::from_str_radix(hex, 16).ok(),
        None => text.parse().ok(),
    }
}

impl Step {
    /// The step's verb, as printed in `ok`/`error` lines.
    pub fn verb(&self) -> &'static str {
        match self {
            Step::Ctx(_) => "ctx",
            Step::CtxCreate(_) => "ctx-create",
            Step::CtxCreateV { version: 3, .. } => "ctx-create-v3",
            Step::CtxCreateV { .. } => "ctx-create-v4",
            Step::CreateHost { .. } => "create-host",
            Step::Retain { .. } => "retain",
            Step::Array { .. } => "array",
            Step::Mipmap { .. } => "mipmap",
            Step::ArrayDestroy { .. } => "array-destroy",
            Step::MipmapDestroy { .. } => "mipmap-destroy",
            Step::Graph { how: GraphHow::Nodes, .. } => "graph",
            Step::Graph { how: GraphHow::Capture, .. } => "graph-capture",
            Step::Graph { how: GraphHow::Clone, .. } => "graph-clone",
            Step::Graph { how: GraphHow::Child, .. } => "graph-child",
            Step::Upload { .. } => "upload",
            Step::Launch { .. } => "launch",
            Step::GraphDestroy { .. } => "graph-destroy",
            Step::GraphTrim => "graph-trim",
            Step::Import { .. } => "import",
            Step::ImportDestroy { .. } => "import-destroy",
            Step::CtxDestroy => "ctx-destroy",
            Step::Alloc { .. } => "alloc",
            Step::Pitch { .. } => "pitch",
            Step::Managed { .. } => "managed",
            Step::Async { ptsz: false, .. } => "async",
            Step::Async { ptsz: true, .. } => "async-ptsz",
            Step::Pool { ptsz: false, .. } => "pool",
            Step::Pool { ptsz: true, .. } => "pool-ptsz",
            Step::Stream { .. } => "stream",
            Step::AsyncOn { .. } => "async-on",
            Step::FreeAsyncOn { .. } => "free-async-on",
            Step::Sync(_) => "sync",
            Step::EventSync(_) => "event-sync",
            Step::CtxSync => "ctx-sync",
            Step::PoolThreshold(_) => "pool-threshold",
            Step::PoolStat => "pool-stat",
            Step::NvmlProcs(_) => "nvml-procs",
            Step::MemPool { .. } => "mempool",
            Step::MemPoolAlloc { .. } => "mempool-alloc",
            Step::MemPoolDestroy { .. } => "mempool-destroy",
            Step::Create { .. } => "create",
            Step::Vmm { .. } => "vmm",
            Step::VmmFree { .. } => "vmm-free",
            Step::Unmap { .. } => "unmap",
            Step::Free { .. } => "free",
            Step::FreeAsync { ptsz: false, .. } => "free-async",
            Step::FreeAsync { ptsz: true, .. } => "free-async-ptsz",
            Step::Release { .. } => "release",
            Step::Trim(_) => "trim",
            Step::Meminfo => "meminfo",
            Step::Devstat(_) => "devstat",
            Step::ExpectOom(_) => "expect-oom",
            Step::Timed(_) => "timed",
            Step::Checkpoint(_) => "checkpoint",
            Step::Sleep(_) => "sleep",
            Step::Stress { .. } => "stress",
            Step::RaceFree { .. } => "race-free",
            Step::Bench { .. } => "bench",
            Step::Hold => "hold",
            Step::Exit(_) => "exit",
            Step::RawExit(_) => "_exit",
            Step::ForkHold => "fork-hold",
            Step::LeaderExit(_) => "leader-exit",
            Step::Kill(_) => "kill",
            Step::Procaddr { .. } => "procaddr",
            Step::Dlsym(_) => "dlsym",
            Step::Calls(_) => "calls",
            Step::Fill { .. } => "fill",
            Step::FreeFill => "free-fill",
            Step::MeminfoNull => "meminfo-null",
            Step::Fork(_) => "fork",
            Step::NvmlMeminfo { .. } => "nvml-meminfo",
            Step::NvmlNull(_) => "nvml-null",
            Step::NvmlUuid(_) => "nvml-uuid",
            Step::Map(_) => "map",
            Step::MapMany(..) => "map-many",
            Step::Swap(..) => "swap",
        }
    }

    /// The name an allocating step gives its result.
    pub fn name(&self) -> Option<&str> {
        match self {
            Step::Alloc { name, .. }
            | Step::Pitch { name, .. }
            | Step::Managed { name, .. }
            | Step::Async { name, .. }
            | Step::Pool { name, .. }
            | Step::MemPool { name }
            | Step::Stream { name }
            | Step::AsyncOn { name, .. }
            | Step::MemPoolAlloc { name, .. }
            | Step::Create { name, .. }
            | Step::CreateHost { name, .. }
            | Step::Array { name, .. }
            | Step::Mipmap { name, .. }
            | Step::Graph { name, .. }
            | Step::Import { name, .. }
            | Step::Vmm { name, .. } => Some(name),
            _ => None,
        }
    }

    /// Parses one step from its words.
    pub fn parse(text: &str) -> Result<Step, ParseError> {
        let words: Vec<&str> = text.split_whitespace().collect();
        let err = |why: &str| ParseError(format!("bad step {text:?}: {why}"));
        let (verb, args) = words.split_first().ok_or_else(|| err("empty"))?;
        let want = |n: usize, usage: &str| {
            if args.len() == n {
                Ok(())
            } else {
                Err(err(&format!("usage: {usage}")))
            }
        };
        let size = |s: &str| parse_size(s).ok_or_else(|| err(&format!("{s:?} is not a size")));
        let int = |s: &str| parse_int(s).ok_or_else(|| err(&format!("{s:?} is not a number")));
        let dev = |s: &str| int(s).and_then(|v| i32::try_from(v).map_err(|_| err("device out of range")));
        let index = |s: &str| int(s).and_then(|v| u32::try_from(v).map_err(|_| err("device index out of range")));
        let name = |i: usize| args[i].to_string();
        let step = match *verb {
            "ctx" => {
                want(1, "ctx DEV")?;
                Step::Ctx(dev(args[0])?)
            }
            "ctx-create" => {
                want(1, "ctx-create DEV")?;
                Step::CtxCreate(dev(args[0])?)
            }
            "ctx-create-v3" | "ctx-create-v4" => {
                want(1, &format!("{verb} DEV"))?;
                Step::CtxCreateV { dev: dev(args[0])?, version: if *verb == "ctx-create-v3" { 3 } else { 4 } }
            }
            "create-host" | "graph" | "graph-capture" | "graph-clone" | "graph-child" | "import" => {
                want(2, &format!("{verb} NAME SIZE"))?;
                let (name, size) = (name(0), size(args[1])?);
                match *verb {
                    "graph" => Step::Graph { name, size, how: GraphHow::Nodes },
                    "graph-capture" => Step::Graph { name, size, how: GraphHow::Capture },
                    "graph-clone" => Step::Graph { name, size, how: GraphHow::Clone },
                    "graph-child" => Step::Graph { name, size, how: GraphHow::Child },
                    "import" => Step::Import { name, size },
                    _ => Step::CreateHost { name, size },
                }
            }
            "retain" | "array-destroy" | "mipmap-destroy" | "launch" | "upload" | "graph-destroy" | "import-destroy" => {
                want(1, &format!("{verb} NAME"))?;
                let name = name(0);
                match *verb {
                    "retain" => Step::Retain { name },
                    "import-destroy" => Step::ImportDestroy { name },
                    "array-destroy" => Step::ArrayDestroy { name },
                    "mipmap-destroy" => Step::MipmapDestroy { name },
                    "launch" => Step::Launch { name },
                    "upload" => Step::Upload { name },
                    _ => Step::GraphDestroy { name },
                }
            }
            "array" => {
                want(4, "array NAME WIDTH HEIGHT DEPTH")?;
                Step::Array { name: name(0), width: size(args[1])?, height: size(args[2])?, depth: size(args[3])? }
            }
            "mipmap" => {
                want(5, "mipmap NAME WIDTH HEIGHT DEPTH LEVELS")?;
                let levels = u32::try_from(int(args[4])?).map_err(|_| err("bad level count"))?;
                Step::Mipmap { name: name(0), width: size(args[1])?, height: size(args[2])?, depth: size(args[3])?, levels }
            }
            "graph-trim" => {
                want(0, "graph-trim")?;
                Step::GraphTrim
            }
            "ctx-destroy" => {
                want(0, "ctx-destroy")?;
                Step::CtxDestroy
            }
            "alloc" | "managed" | "async" | "async-ptsz" | "pool" | "pool-ptsz" | "create" | "vmm" => {
                want(2, &format!("{verb} NAME SIZE"))?;
                let (name, size) = (name(0), size(args[1])?);
                match *verb {
                    "alloc" => Step::Alloc { name, size },
                    "managed" => Step::Managed { name, size },
                    "async" => Step::Async { name, size, ptsz: false },
                    "async-ptsz" => Step::Async { name, size, ptsz: true },
                    "pool" => Step::Pool { name, size, ptsz: false },
                    "pool-ptsz" => Step::Pool { name, size, ptsz: true },
                    "create" => Step::Create { name, size },
                    _ => Step::Vmm { name, size },
                }
            }
            "mempool" | "mempool-destroy" => {
                want(1, &format!("{verb} POOL"))?;
                let name = name(0);
                if *verb == "mempool" { Step::MemPool { name } } else { Step::MemPoolDestroy { name } }
            }
            "stream" => {
                want(1, "stream NAME")?;
                Step::Stream { name: name(0) }
            }
            "async-on" => {
                want(3, "async-on NAME SIZE STREAM")?;
                Step::AsyncOn { name: name(0), size: size(args[1])?, stream: name(2) }
            }
            "free-async-on" => {
                want(2, "free-async-on NAME STREAM")?;
                Step::FreeAsyncOn { name: name(0), stream: name(1) }
            }
            "sync" | "event-sync" => {
                if args.len() > 1 {
                    return Err(err(&format!("usage: {verb} [STREAM]")));
                }
                let stream = args.first().map(|s| s.to_string());
                if *verb == "sync" { Step::Sync(stream) } else { Step::EventSync(stream) }
            }
            "ctx-sync" => {
                want(0, "ctx-sync")?;
                Step::CtxSync
            }
            "pool-threshold" => {
                want(1, "pool-threshold BYTES")?;
                Step::PoolThreshold(size(args[0])?)
            }
            "pool-stat" => {
                want(0, "pool-stat")?;
                Step::PoolStat
            }
            "nvml-procs" => {
                want(1, "nvml-procs DEV")?;
                Step::NvmlProcs(index(args[0])?)
            }
            "mempool-alloc" => {
                want(3, "mempool-alloc NAME SIZE POOL")?;
                Step::MemPoolAlloc { name: name(0), size: size(args[1])?, pool: name(2) }
            }
            "pitch" => {
                want(4, "pitch NAME WIDTH HEIGHT ELEM")?;
                let elem = u32::try_from(int(args[3])?).map_err(|_| err("bad element size"))?;
                Step::Pitch { name: name(0), width: size(args[1])?, height: size(args[2])?, elem }
            }
            "free" | "free-async" | "free-async-ptsz" | "release" | "vmm-free" | "unmap" => {
                want(1, &format!("{verb} NAME"))?;
                let name = name(0);
                match *verb {
                    "free" => Step::Free { name },
                    "free-async" => Step::FreeAsync { name, ptsz: false },
                    "free-async-ptsz" => Step::FreeAsync { name, ptsz: true },
                    "release" => Step::Release { name },
                    "unmap" => Step::Unmap { name },
                    _ => Step::VmmFree { name },
                }
            }
            "trim" => {
                want(1, "trim BYTES")?;
                Step::Trim(size(args[0])?)
            }
            "meminfo" => {
                want(0, "meminfo")?;
                Step::Meminfo
            }
            "devstat" => {
                want(1, "devstat DEV")?;
                Step::Devstat(dev(args[0])?)
            }
            "timed" => {
                if args.is_empty() {
                    return Err(err("usage: timed STEP..."));
                }
                Step::Timed(Box::new(Step::parse(&args.join(" "))?))
            }
            "expect-oom" => {
                if args.is_empty() {
                    return Err(err("usage: expect-oom STEP..."));
                }
                Step::ExpectOom(Box::new(Step::parse(&args.join(" "))?))
            }
            "checkpoint" => {
                want(1, "checkpoint NAME")?;
                Step::Checkpoint(name(0))
            }
            "sleep" => {
                want(1, "sleep MS")?;
                Step::Sleep(u64::try_from(int(args[0])?).map_err(|_| err("negative"))?)
            }
            "stress" => {
                want(3, "stress THREADS PAIRS SIZE")?;
                let threads = u32::try_from(int(args[0])?).map_err(|_| err("bad thread count"))?;
                let pairs = u64::try_from(int(args[1])?).map_err(|_| err("bad pair count"))?;
                if threads == 0 || threads > 1024 {
                    return Err(err("THREADS must be 1..=1024"));
                }
                Step::Stress { threads, pairs, size: size(args[2])? }
            }
            "race-free" => {
                want(3, "race-free THREADS ROUNDS SIZE")?;
                let threads = u32::try_from(int(args[0])?).map_err(|_| err("bad thread count"))?;
                let rounds = u64::try_from(int(args[1])?).map_err(|_| err("bad round count"))?;
                if threads == 0 || threads > 1024 {
                    return Err(err("THREADS must be 1..=1024"));
                }
                Step::RaceFree { threads, rounds, size: size(args[2])? }
            }
            "fill" => {
                want(2, "fill THREADS SIZE")?;
                let threads = u32::try_from(int(args[0])?).map_err(|_| err("bad thread count"))?;
                if threads == 0 || threads > 1024 {
                    return Err(err("THREADS must be 1..=1024"));
                }
                let size = size(args[1])?;
                if size == 0 {
                    return Err(err("SIZE must not be 0"));
                }
                Step::Fill { threads, size }
            }
            "free-fill" => {
                want(0, "free-fill")?;
                Step::FreeFill
            }
            "meminfo-null" => {
                want(0, "meminfo-null")?;
                Step::MeminfoNull
            }
            "nvml-meminfo" => {
                let global = match args {
                    [_] => false,
                    [_, "global"] => true,
                    _ => return Err(err("usage: nvml-meminfo DEV [global]")),
                };
                Step::NvmlMeminfo { dev: index(args[0])?, global }
            }
            "nvml-null" => {
                want(1, "nvml-null DEV")?;
                Step::NvmlNull(index(args[0])?)
            }
            "nvml-uuid" => {
                want(1, "nvml-uuid DEV")?;
                Step::NvmlUuid(index(args[0])?)
            }
            "fork" => {
                let steps: Vec<Step> = args
                    .join(" ")
                    .split(';')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(Step::parse)
                    .collect::<Result<_, _>>()?;
                if steps.is_empty() {
                    return Err(err("usage: fork STEP[; STEP]..."));
                }
                Step::Fork(steps)
            }
            "bench" => {
                want(2, "bench PAIRS SIZE")?;
                let pairs = u64::try_from(int(args[0])?).map_err(|_| err("bad pair count"))?;
                Step::Bench { pairs, size: size(args[1])? }
            }
            "hold" => {
                want(0, "hold")?;
                Step::Hold
            }
            "exit" => {
                want(1, "exit CODE")?;
                Step::Exit(i32::try_from(int(args[0])?).map_err(|_| err("bad exit code"))?)
            }
            "_exit" => {
                want(1, "_exit CODE")?;
                Step::RawExit(i32::try_from(int(args[0])?).map_err(|_| err("bad exit code"))?)
            }
            "fork-hold" => {
                want(0, "fork-hold")?;
                Step::ForkHold
            }
            "leader-exit" => match args.len() {
                0 => Step::LeaderExit(None),
                1 => Step::LeaderExit(Some(name(0))),
                _ => return Err(err("usage: leader-exit [PATH]")),
            },
            "kill" => match args.len() {
                0 => Step::Kill(None),
                1 => Step::Kill(Some(name(0))),
                _ => return Err(err("usage: kill [PATH]")),
            },
            "map" => {
                want(1, "map PATH")?;
                Step::Map(name(0))
            }
            "map-many" => {
                want(2, "map-many COUNT PATH")?;
                Step::MapMany(u64::try_from(int(args[0])?).map_err(|_| err("bad count"))?, name(1))
            }
            "swap" => {
                want(2, "swap PATH PATH")?;
                Step::Swap(name(0), name(1))
            }
            "procaddr" => {
                if args.is_empty() || args.len() > 4 {
                    return Err(err("usage: procaddr QUERY [EXPORT|-] [VERSION] [FLAGS]"));
                }
                let export = args.get(1).filter(|e| **e != "-").map(|e| e.to_string());
                let version = match args.get(2) {
                    Some(v) => i32::try_from(int(v)?).map_err(|_| err("bad version"))?,
                    None => 12000,
                };
                let flags = match args.get(3) {
                    Some(f) => u64::try_from(int(f)?).map_err(|_| err("bad flags"))?,
                    None => 0,
                };
                Step::Procaddr { query: name(0), export, version, flags }
            }
            "dlsym" | "calls" => {
                if args.is_empty() {
                    return Err(err(&format!("usage: {verb} SYMBOL...")));
                }
                let names = args.iter().map(|s| s.to_string()).collect();
                if *verb == "dlsym" {
                    Step::Dlsym(names)
                } else {
                    Step::Calls(names)
                }
            }
            other => return Err(err(&format!("unknown step {other:?}"))),
        };
        Ok(step)
    }

    /// Parses a script: one step per line, `#` starts a comment.
    pub fn parse_script(text: &str) -> Result<Vec<Step>, ParseError> {
        text.lines()
            .map(|l| l.split('#').next().unwrap_or("").trim())
            .filter(|l| !l.is_empty())
            .map(Step::parse)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_steps() {
        assert_eq!(Step::parse("alloc a 4m").ok(), Some(Step::Alloc { name: "a".into(), size: 4 << 20 }));
        assert_eq!(
            Step::parse("expect-oom alloc big 20g").ok(),
            Some(Step::ExpectOom(Box::new(Step::Alloc { name: "big".into(), size: 20 << 30 })))
        );
        assert_eq!(
            Step::parse("pitch p 1000 100 4").ok(),
            Some(Step::Pitch { name: "p".into(), width: 1000, height: 100, elem: 4 })
        );
        assert!(Step::parse("alloc a").is_err());
        assert!(Step::parse("alloc a 4q").is_err());
        assert!(Step::parse("frobnicate").is_err());
        assert_eq!(Step::parse("fill 4 8m").ok(), Some(Step::Fill { threads: 4, size: 8 << 20 }));
        assert!(Step::parse("fill 0 8m").is_err());
        assert!(Step::parse("fill 2 0").is_err());
        assert_eq!(Step::parse("free-fill").ok(), Some(Step::FreeFill));
        assert_eq!(Step::parse("unmap v").ok(), Some(Step::Unmap { name: "v".into() }));
        assert_eq!(Step::parse("ctx-create-v3 1").ok(), Some(Step::CtxCreateV { dev: 1, version: 3 }));
        assert_eq!(
            Step::parse("array a 1000 1000 0").ok(),
            Some(Step::Array { name: "a".into(), width: 1000, height: 1000, depth: 0 })
        );
        assert_eq!(
            Step::parse("mipmap m 256 256 256 2").ok(),
            Some(Step::Mipmap { name: "m".into(), width: 256, height: 256, depth: 256, levels: 2 })
        );
        assert_eq!(Step::parse("graph g 512m").ok(), Some(Step::Graph { name: "g".into(), size: 512 << 20, how: GraphHow::Nodes }));
        assert_eq!(Step::parse("graph-capture g 2m").ok(), Some(Step::Graph { name: "g".into(), size: 2 << 20, how: GraphHow::Capture }));
        assert_eq!(Step::parse("graph-child g 2m").map(|s| s.verb()).ok(), Some("graph-child"));
        assert_eq!(Step::parse("upload g").ok(), Some(Step::Upload { name: "g".into() }));
        assert!(Step::parse("launch").is_err());
        assert_eq!(Step::parse("graph-trim").ok(), Some(Step::GraphTrim));
        assert_eq!(Step::parse("import x 64m").ok(), Some(Step::Import { name: "x".into(), size: 64 << 20 }));
        assert_eq!(Step::parse("import-destroy x").ok(), Some(Step::ImportDestroy { name: "x".into() }));
        assert!(Step::parse("import x").is_err());
        assert_eq!(Step::parse("meminfo-null").ok(), Some(Step::MeminfoNull));
        assert_eq!(
            Step::parse("fork ctx 0; alloc b 2m ;checkpoint c").ok(),
            Some(Step::Fork(vec![
                Step::Ctx(0),
                Step::Alloc { name: "b".into(), size: 2 << 20 },
                Step::Checkpoint("c".into())
            ]))
        );
        assert!(Step::parse("fork").is_err());
        assert_eq!(Step::parse("nvml-meminfo 1").ok(), Some(Step::NvmlMeminfo { dev: 1, global: false }));
        assert_eq!(Step::parse("nvml-meminfo 0 global").ok(), Some(Step::NvmlMeminfo { dev: 0, global: true }));
        assert!(Step::parse("nvml-meminfo 0 local").is_err());
        assert!(Step::parse("nvml-meminfo -1").is_err());
        assert_eq!(Step::parse("nvml-null 0").ok(), Some(Step::NvmlNull(0)));
        assert_eq!(Step::parse("nvml-uuid 2").ok(), Some(Step::NvmlUuid(2)));
        assert_eq!(Step::parse("stream s").ok(), Some(Step::Stream { name: "s".into() }));
        assert_eq!(
            Step::parse("async-on a 700m s").ok(),
            Some(Step::AsyncOn { name: "a".into(), size: 700 << 20, stream: "s".into() })
        );
        assert_eq!(Step::parse("free-async-on a s").ok(), Some(Step::FreeAsyncOn { name: "a".into(), stream: "s".into() }));
        assert_eq!(Step::parse("sync").ok(), Some(Step::Sync(None)));
        assert_eq!(Step::parse("sync s").ok(), Some(Step::Sync(Some("s".into()))));
        assert_eq!(Step::parse("event-sync").ok(), Some(Step::EventSync(None)));
        assert!(Step::parse("sync a b").is_err());
        assert_eq!(Step::parse("ctx-sync").ok(), Some(Step::CtxSync));
        assert_eq!(Step::parse("pool-threshold 1g").ok(), Some(Step::PoolThreshold(1 << 30)));
        assert_eq!(Step::parse("pool-stat").ok(), Some(Step::PoolStat));
        assert_eq!(Step::parse("nvml-procs 0").ok(), Some(Step::NvmlProcs(0)));
        assert_eq!(Step::parse("kill").ok(), Some(Step::Kill(None)));
        assert_eq!(Step::parse("kill /x/stamp").ok(), Some(Step::Kill(Some("/x/stamp".into()))));
        assert!(Step::parse("kill a b").is_err());
        assert_eq!(Step::parse("map /x/lib.so").ok(), Some(Step::Map("/x/lib.so".into())));
        assert_eq!(Step::parse("leader-exit").ok(), Some(Step::LeaderExit(None)));
        assert_eq!(Step::parse("leader-exit /x/lib.so").ok(), Some(Step::LeaderExit(Some("/x/lib.so".into()))));
        assert!(Step::parse("leader-exit /a /b").is_err());
        assert_eq!(Step::parse("map-many 3 /x/f").ok(), Some(Step::MapMany(3, "/x/f".into())));
        assert_eq!(Step::parse("swap /a /b").ok(), Some(Step::Swap("/a".into(), "/b".into())));
        assert!(Step::parse("swap /a").is_err());
        assert!(Step::parse("fork ctx 0; frobnicate").is_err());
        let script = Step::parse_script("# setup\nctx 0\n\nalloc a 1k # small\n").expect("script");
        assert_eq!(script, vec![Step::Ctx(0), Step::Alloc { name: "a".into(), size: 1024 }]);
    }
}
