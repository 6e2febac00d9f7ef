//! The fake driver's semantics, checked with real processes: granularity, OOM, machine-wide
//! devices shared by processes, reaping of dead processes, pools, VMM, contexts,
//! `cuGetProcAddress`, configuration errors, and the fake NVML.
//!
//! Needs `cargo build -p fakecuda -p workload` first (same profile).

use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use e2e::{field, parse_ok, FakeNode, Via, DEFAULT_CONTEXT_BYTES as CTX, GIB, KIB, MIB};

/// The `used=` values of every `devstat` line, in order.
fn devstats(out: &e2e::Finished) -> Result<Vec<u64>> {
    out.lines("devstat ").map(|l| field(l, "used")).collect()
}

#[test]
fn granularity_matches_the_h100_figures() -> Result<()> {
    // (count, size, expected device delta) from docs/design.md, "Platform facts".
    let cases = [(1000, 512, 2 * MIB), (200, 64 * KIB, 14 * MIB), (200, MIB, 200 * MIB), (100, 2 * MIB, 200 * MIB), (100, 3 * MIB, 400 * MIB)];
    for (count, size, expected) in cases {
        let node = FakeNode::new("granularity");
        let mut steps = vec!["ctx 0".to_string(), "devstat 0".to_string()];
        steps.extend((0..count).map(|i| format!("alloc a{i} {size}")));
        steps.push("devstat 0".into());
        steps.push("meminfo".into());
        steps.extend((0..count).map(|i| format!("free a{i}")));
        steps.push("devstat 0".into());
        let out = node.workload().steps(steps).run()?.success()?;
        let used = devstats(&out)?;
        ensure!(used.len() == 3, "devstat lines: {used:?}");
        assert_eq!(used[0], CTX, "context reserve before allocating");
        assert_eq!(used[1] - used[0], expected, "{count} x {size} B");
        assert_eq!(used[2], CTX, "{count} x {size} B all freed");
        let meminfo = out.line("meminfo ")?;
        assert_eq!(field(meminfo, "total")? - field(meminfo, "free")?, used[1], "meminfo agrees with devstat");
        // Distinct pointers, aligned as promised.
        let mut ptrs: Vec<u64> = out.lines("ok alloc ").map(|l| parse_ok(l).map(|o| o.2)).collect::<Result<_>>()?;
        let align = if size >= 2 * MIB { 2 * MIB } else { 256 };
        assert!(ptrs.iter().all(|p| p % align == 0), "{count} x {size} B: alignment {align}");
        ptrs.sort_unstable();
        ptrs.dedup();
        assert_eq!(ptrs.len(), count, "{count} x {size} B: distinct pointers");
    }
    Ok(())
}

#[test]
fn small_allocations_share_pages_until_freed() -> Result<()> {
    let node = FakeNode::new("small-pages");
    let mut steps = vec!["ctx 0".to_string()];
    steps.extend((0..200).map(|i| format!("alloc s{i} 64k")));
    steps.extend((0..100).map(|i| format!("free s{i}")));
    steps.push("devstat 0".into());
    // A 2 MiB allocation never shares pages with the small ones.
    steps.push("alloc big 2m".into());
    steps.push("devstat 0".into());
    let used = devstats(&node.workload().steps(steps).run()?.success()?)?;
    // 100 x 64 KiB = 6.25 MiB live -> 4 pages.
    assert_eq!(used, vec![CTX + 8 * MIB, CTX + 10 * MIB]);
    Ok(())
}

#[test]
fn pitch_and_managed_charge_like_alloc() -> Result<()> {
    let node = FakeNode::new("pitch");
    let out = node
        .workload()
        .steps(["ctx 0", "pitch p 1000 100 4", "devstat 0", "pitch q 4096 1024 8", "devstat 0", "managed m 3m", "devstat 0"])
        .run()?
        .success()?;
    let (_, _, _, bytes) = parse_ok(out.line("ok pitch p ")?)?;
    assert_eq!(bytes, 1024 * 100, "pitch 1000 rounds up to 1024");
    assert_eq!(devstats(&out)?, vec![CTX + 2 * MIB, CTX + 6 * MIB, CTX + 10 * MIB]);

    let bad = node.workload().steps(["ctx 0", "pitch p 1000 100 3"]).run()?;
    assert_eq!(bad.code(), Some(1));
    assert!(bad.stderr.contains("error pitch 1 CUDA_ERROR_INVALID_VALUE"), "{}", bad.stderr);
    Ok(())
}

#[test]
fn oom_when_full_charges_nothing() -> Result<()> {
    let node = FakeNode::new("oom").with_env("FAKECUDA_DEVICE_BYTES", "256m");
    let out = node
        .workload()
        .steps([
            "ctx 0",
            "alloc a 150m",
            "devstat 0",
            "expect-oom alloc big 100m",
            "expect-oom async big2 100m",
            "expect-oom create big3 100m",
            "expect-oom ctx-create 0",
            "expect-oom alloc huge 1t",
            "devstat 0",
            "alloc fill 42m", // exactly full
            "devstat 0",
            "meminfo",
            "expect-oom alloc tiny 1",
            "free fill",
            "alloc tiny 1",
            "devstat 0",
        ])
        .run()?
        .success()?;
    let ooms: Vec<&str> = out.lines("oom ").collect();
    assert_eq!(ooms, ["oom big", "oom big2", "oom big3", "oom ctx-create", "oom huge", "oom tiny"]);
    assert_eq!(devstats(&out)?, vec![CTX + 150 * MIB, CTX + 150 * MIB, 256 * MIB, CTX + 152 * MIB]);
    assert_eq!(field(out.line("meminfo ")?, "free")?, 0);
    Ok(())
}

#[test]
fn processes_share_a_device() -> Result<()> {
    let node = FakeNode::new("share").with_env("FAKECUDA_DEVICE_BYTES", "1g");
    let mut a = node.workload().steps(["ctx 0", "alloc a 300m", "checkpoint held", "free a", "checkpoint freed"]).spawn()?;
    a.wait_checkpoint("held")?;
    let mut b = node
        .workload()
        .steps(["ctx 0", "meminfo", "expect-oom alloc b 600m", "checkpoint b1", "meminfo", "alloc b 600m", "meminfo"])
        .spawn()?;
    let free = field(&b.expect_prefix("meminfo ")?, "free")?;
    assert_eq!(free, GIB - (CTX + 300 * MIB) - CTX, "B sees A's context and allocation");
    assert_eq!(b.expect_prefix("oom ")?, "oom b");
    b.wait_checkpoint("b1")?;
    a.resume()?;
    a.wait_checkpoint("freed")?;
    b.resume()?;
    assert_eq!(field(&b.expect_prefix("meminfo ")?, "free")?, GIB - 2 * CTX);
    b.expect_prefix("ok alloc b ")?;
    assert_eq!(field(&b.expect_prefix("meminfo ")?, "free")?, GIB - 2 * CTX - 600 * MIB);
    b.wait()?.success()?;
    a.wait()?.success()?;
    assert_eq!(node.used(0)?, 0, "both exited: everything back");
    Ok(())
}

#[test]
fn concurrent_processes_never_overshoot() -> Result<()> {
    let node = FakeNode::new("overshoot").with_env("FAKECUDA_DEVICE_BYTES", "1g").with_env("FAKECUDA_CONTEXT_BYTES", "0");
    let steps = ["ctx 0", "alloc x 128m", "alloc y 128m", "alloc z 128m", "checkpoint hold"];
    let mut procs: Vec<_> = (0..6).map(|_| node.workload().steps(steps).spawn()).collect::<Result<_>>()?;
    // Each process either holds at its checkpoint or died of OOM (exit 1).
    let mut held = 0u64;
    let mut survivors = Vec::new();
    for mut p in procs.drain(..) {
        let mut bytes = 0;
        let reached = loop {
            match p.next_line() {
                Ok(l) if l.starts_with("ok alloc ") => bytes += parse_ok(&l)?.3,
                Ok(l) if l == "checkpoint hold" => break true,
                Ok(_) => {}
                Err(_) => break false,
            }
        };
        if reached {
            held += bytes;
            survivors.push(p);
        } else {
            let out = p.wait()?;
            assert_eq!(out.code(), Some(1), "{out:?}");
            assert!(out.stderr.contains("CUDA_ERROR_OUT_OF_MEMORY"), "{}", out.stderr);
        }
    }
    let used = node.used(0)?;
    assert_eq!(used, held, "device use is what the surviving processes hold");
    assert!(used <= GIB, "overshoot: {used}");
    // (All six may also run out together and exit: that is fine, overshoot is not.)
    assert!(survivors.len() <= 2, "1 GiB holds at most two 384 MiB holders, not {}", survivors.len());
    for p in survivors {
        p.wait()?.success()?;
    }
    assert_eq!(node.used(0)?, 0);
    Ok(())
}

fn wait_for_zombie(pid: u32) -> Result<()> {
    let deadline = Instant::now() + e2e::timeout();
    loop {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).with_context(|| format!("pid {pid}"))?;
        let state = stat.rsplit(')').next().and_then(|r| r.split_whitespace().next());
        if state == Some("Z") {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("pid {pid} did not die: {stat}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn dead_processes_memory_returns_to_the_device() -> Result<()> {
    let node = FakeNode::new("reap");
    let holding = ["ctx 0", "alloc a 100m", "async p 10m", "create h 4m", "checkpoint held"];

    // SIGKILL from outside, checked while the process is still an unreaped zombie.
    let mut w = node.workload().steps(holding).spawn()?;
    w.wait_checkpoint("held")?;
    assert_eq!(node.used(0)?, CTX + 100 * MIB + 10 * MIB + 4 * MIB);
    w.signal(libc::SIGKILL)?;
    wait_for_zombie(w.pid())?;
    assert_eq!(node.used(0)?, 0, "a zombie holds no device memory");
    assert_eq!(w.wait()?.status.code(), None, "killed by a signal");

    // The process kills itself, or exits without freeing.
    for last in ["kill", "exit 3"] {
        let mut steps = holding.to_vec();
        steps.pop();
        steps.push(last);
        let out = node.workload().steps(steps).run()?;
        assert!(!out.status.success(), "{last}: {out:?}");
        assert_eq!(node.used(0)?, 0, "after {last}");
    }

    // An allocation that would run out reaps dead processes first: A dies after B's cuInit
    // (which reaps too), so only B's allocation can find A's memory.
    let small = FakeNode::new("reap-oom").with_env("FAKECUDA_DEVICE_BYTES", "512m").with_env("FAKECUDA_CONTEXT_BYTES", "0");
    let mut a = small.workload().steps(["ctx 0", "alloc a 400m", "checkpoint held"]).spawn()?;
    a.wait_checkpoint("held")?;
    let mut b = small.workload().steps(["ctx 0", "checkpoint go", "alloc b 400m"]).spawn()?;
    b.wait_checkpoint("go")?;
    a.signal(libc::SIGKILL)?;
    wait_for_zombie(a.pid())?;
    b.resume()?;
    b.expect_prefix("ok alloc b ")?;
    b.wait()?.success()?;
    a.wait()?;
    Ok(())
}

#[test]
fn pools_keep_reserved_memory_until_trimmed() -> Result<()> {
    let node = FakeNode::new("pools");
    for via in [Via::Dlsym, Via::Getproc] {
        let out = node
            .workload()
            .via(via)
            .steps([
                "ctx 0",
                "async a 1m",
                "devstat 0", // reserved 2m
                "async b 3m",
                "devstat 0", // used 4m -> reserved 4m
                "free-async a",
                "free-async b",
                "devstat 0", // still reserved
                "trim 0",
                "devstat 0",
                "async-ptsz c 10m",
                "free-async-ptsz c",
                "trim 4m",
                "devstat 0", // kept 4m
                "trim 0",
                "devstat 0",
                "pool d 1m",
                "pool-ptsz e 1m",
                "free d", // cuMemFree_v2 on a pool allocation
                "trim 0",
                "devstat 0", // e still live: 1m -> one page
                "free-async-ptsz e",
                "trim 3m",
                "devstat 0", // min(reserved 2m, 3m) -> 2m kept
                "trim 0",
                "devstat 0",
            ])
            .run()?
            .success()?;
        let expected: Vec<u64> = [2, 4, 4, 0, 4, 0, 2, 2, 0].iter().map(|m| CTX + m * MIB).collect();
        assert_eq!(devstats(&out)?, expected, "{via:?}");
    }
    let bad = node.workload().steps(["ctx 0", "alloc a 1m", "free-async a"]).run()?;
    assert!(bad.stderr.contains("error free-async 1 CUDA_ERROR_INVALID_VALUE"), "{}", bad.stderr);
    Ok(())
}

/// As the driver's, a pool's allocation takes one contiguous free range: memory freed in
/// pieces serves what fits in a piece, and a larger allocation grows the pool although its
/// free part is large enough in sum (the growth extends a free range at the pool's end).
#[test]
fn a_pool_whose_free_part_is_in_pieces_grows_for_what_no_piece_holds() -> Result<()> {
    let node = FakeNode::new("pieces");
    let out = node
        .workload()
        .steps([
            "ctx 0",
            "async a 4m",
            "async b 4m",
            "async c 4m",
            "free-async a",
            "free-async c",
            "devstat 0", // 12m reserved, 8m of it free in two pieces
            "async d 6m",
            "devstat 0", // no piece holds 6m: c's, at the end, grows by 2m
            "async e 4m",
            "devstat 0", // a's piece holds it
            "free-async b",
            "free-async e",
            "async f 10m",
            "devstat 0", // a's and b's pieces joined: 8m free at the start, not 10m: grows at the end
            "free-async d",
            "free-async f",
            "async g 24m",
            "devstat 0", // all joined again: 24m holds it
            "free-async g",
            "trim 0",
            "devstat 0",
        ])
        .run()?
        .success()?;
    let expected: Vec<u64> = [12, 14, 14, 24, 24, 0].iter().map(|m| CTX + m * MIB).collect();
    assert_eq!(devstats(&out)?, expected);
    Ok(())
}

#[test]
fn vmm_handles_charge_until_released_and_unmapped() -> Result<()> {
    let node = FakeNode::new("vmm");
    let out = node
        .workload()
        .steps(["ctx 0", "create c 4m", "devstat 0", "release c", "devstat 0", "vmm v 6m", "devstat 0", "vmm-free v", "devstat 0"])
        .run()?
        .success()?;
    assert_eq!(devstats(&out)?, vec![CTX + 4 * MIB, CTX, CTX + 6 * MIB, CTX]);
    let (_, _, handle, _) = parse_ok(out.line("ok create c ")?)?;
    assert!(handle >= 1 << 48, "handles never look like device pointers: {handle:#x}");
    for (steps, err) in [
        (vec!["ctx 0", "create c 3m"], "error create 1 "),
        (vec!["ctx 0", "create c 2m", "release c", "release c"], "error release 1 "),
    ] {
        let bad = node.workload().steps(steps).run()?;
        assert!(bad.stderr.contains(err), "{}", bad.stderr);
    }
    Ok(())
}

#[test]
fn context_reserve_is_charged_once_per_context() -> Result<()> {
    let node = FakeNode::new("contexts").with_env("FAKECUDA_DEVICE_COUNT", "2");
    let out = node
        .workload()
        .steps([
            "ctx 0",
            "devstat 0",
            "ctx 0", // retaining the primary context again costs nothing
            "devstat 0",
            "ctx-create 0",
            "alloc inctx 10m",
            "devstat 0",
            "ctx-destroy", // frees the context and what was allocated in it
            "devstat 0",
            "ctx-destroy",
            "devstat 0",
            "ctx-destroy", // last release
            "devstat 0",
            "ctx 1",
            "devstat 0",
            "devstat 1",
        ])
        .run()?
        .success()?;
    assert_eq!(devstats(&out)?, vec![CTX, CTX, 2 * CTX + 10 * MIB, CTX, CTX, 0, 0, CTX]);

    let custom = FakeNode::new("contexts-custom").with_env("FAKECUDA_CONTEXT_BYTES", "518m");
    assert_eq!(devstats(&custom.workload().steps(["ctx 0", "devstat 0"]).run()?.success()?)?, vec![518 * MIB]);
    Ok(())
}

#[test]
fn get_proc_address_returns_the_exported_functions() -> Result<()> {
    let node = FakeNode::new("getproc");
    // (query, export expected or "-", version, flags, code, status)
    let cases: &[(&str, &str, i32, u64, u64, u64)] = &[
        ("cuMemAlloc", "cuMemAlloc_v2", 12000, 0, 0, 0),
        ("cuMemAlloc", "cuMemAlloc_v2", 13000, 0, 0, 0),
        ("cuMemFree", "cuMemFree_v2", 12000, 0, 0, 0),
        ("cuMemGetInfo", "cuMemGetInfo_v2", 12000, 0, 0, 0),
        ("cuMemAllocPitch", "cuMemAllocPitch_v2", 12000, 0, 0, 0),
        ("cuDeviceTotalMem", "cuDeviceTotalMem_v2", 12000, 0, 0, 0),
        ("cuCtxCreate", "cuCtxCreate_v2", 11030, 0, 0, 0),
        ("cuCtxCreate", "cuCtxCreate_v3", 11040, 0, 0, 0),
        ("cuCtxCreate", "cuCtxCreate_v3", 12040, 0, 0, 0),
        ("cuCtxCreate", "cuCtxCreate_v4", 12050, 0, 0, 0),
        ("cuCtxCreate", "cuCtxCreate_v4", 13000, 0, 0, 0),
        ("cuCtxDestroy", "cuCtxDestroy_v2", 12000, 0, 0, 0),
        ("cuDevicePrimaryCtxRelease", "cuDevicePrimaryCtxRelease_v2", 12000, 0, 0, 0),
        ("cuDevicePrimaryCtxRelease", "cuDevicePrimaryCtxRelease", 10020, 0, 0, 0),
        ("cuDeviceGetUuid", "cuDeviceGetUuid_v2", 11040, 0, 0, 0),
        ("cuDeviceGetUuid", "cuDeviceGetUuid", 11030, 0, 0, 0),
        ("cuGetProcAddress", "cuGetProcAddress_v2", 12000, 0, 0, 0),
        ("cuGetProcAddress", "cuGetProcAddress", 11080, 0, 0, 0),
        ("cuMemAllocAsync", "cuMemAllocAsync", 12000, 0, 0, 0),
        ("cuMemAllocAsync", "cuMemAllocAsync", 12000, 1, 0, 0),
        ("cuMemAllocAsync", "cuMemAllocAsync_ptsz", 12000, 2, 0, 0),
        ("cuMemFreeAsync", "cuMemFreeAsync_ptsz", 12000, 2, 0, 0),
        ("cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync_ptsz", 12000, 2, 0, 0),
        ("cuMemAlloc", "cuMemAlloc_v2", 12000, 2, 0, 0),
        ("cuMemCreate", "cuMemCreate", 12000, 0, 0, 0),
        ("cuInit", "cuInit", 12000, 0, 0, 0),
        ("cuMemAllocAsync", "-", 11000, 0, 500, 2),
        ("cuMemAlloc_v2", "-", 12000, 0, 500, 1),
        ("cuNoSuchThing", "-", 12000, 0, 500, 1),
        ("fakecuda_device_usage", "-", 12000, 0, 500, 1),
    ];
    let steps: Vec<String> = cases.iter().map(|(q, e, v, f, _, _)| format!("procaddr {q} {e} {v} {f}")).collect();
    let out = node.workload().steps(steps).run()?.success()?;
    let lines: Vec<&str> = out.lines("procaddr ").collect();
    assert_eq!(lines.len(), cases.len());
    for (line, &(query, export, _, _, code, status)) in lines.iter().zip(cases) {
        assert_eq!(field(line, "code")?, code, "{line}");
        if code == 0 {
            let got = field(line, "getproc")?;
            assert!(got != 0 && got == field(line, "dlsym")?, "{query} should be {export}: {line}");
        } else {
            assert_eq!(field(line, "status")?, status, "{line}");
            assert_eq!(field(line, "getproc")?, 0, "{line}");
        }
    }

    // A whole workload through cuGetProcAddress_v2 lands on the exported symbols.
    let out = node
        .workload()
        .via(Via::Getproc)
        .steps([
            "ctx 0",
            "alloc a 1m",
            "free a",
            "async-ptsz b 1m",
            "free-async-ptsz b",
            "pool-ptsz c 1m",
            "free-async-ptsz c",
            "vmm v 2m",
            "vmm-free v",
            "calls cuMemAlloc_v2 cuMemFree_v2 cuMemAllocAsync cuMemAllocAsync_ptsz cuMemFreeAsync_ptsz cuMemAllocFromPoolAsync_ptsz cuMemCreate cuMemMap cuMemRelease",
        ])
        .run()?
        .success()?;
    let calls: Vec<&str> = out.lines("calls ").collect();
    assert_eq!(
        calls,
        [
            "calls cuMemAlloc_v2 1",
            "calls cuMemFree_v2 1",
            "calls cuMemAllocAsync 0",
            "calls cuMemAllocAsync_ptsz 1",
            "calls cuMemFreeAsync_ptsz 2",
            "calls cuMemAllocFromPoolAsync_ptsz 1",
            "calls cuMemCreate 1",
            "calls cuMemMap 1",
            "calls cuMemRelease 1",
        ]
    );
    Ok(())
}

/// Every exported entry point, for the distinct-address check.
const EXPORTS: &[&str] = &[
    "cuInit", "cuDriverGetVersion", "cuDeviceGet", "cuDeviceGetCount", "cuDeviceGetName", "cuDeviceGetUuid",
    "cuDeviceGetUuid_v2", "cuDeviceTotalMem_v2", "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease",
    "cuDevicePrimaryCtxRelease_v2", "cuCtxCreate_v2", "cuCtxCreate_v4", "cuCtxDestroy_v2", "cuCtxSetCurrent",
    "cuCtxGetCurrent", "cuCtxGetDevice", "cuMemAlloc_v2", "cuMemAllocPitch_v2", "cuMemAllocManaged", "cuMemFree_v2",
    "cuMemGetInfo_v2", "cuMemAllocAsync", "cuMemAllocAsync_ptsz", "cuMemFreeAsync", "cuMemFreeAsync_ptsz",
    "cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync_ptsz", "cuDeviceGetMemPool", "cuMemPoolTrimTo", "cuMemCreate",
    "cuMemRelease", "cuMemAddressReserve", "cuMemAddressFree", "cuMemMap", "cuMemUnmap", "cuMemSetAccess",
    "cuMemGetAllocationGranularity", "cuGetProcAddress", "cuGetProcAddress_v2", "cuGetErrorString", "cuGetErrorName",
    "nvmlInit", "nvmlInit_v2", "nvmlShutdown", "nvmlDeviceGetCount_v2", "nvmlDeviceGetHandleByIndex_v2",
    "nvmlDeviceGetUUID", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo_v2", "nvmlErrorString",
    "fakecuda_device_usage", "fakecuda_api_calls",
    // Arrays, graph memory, VMM references, cuCtxCreate_v3 (fakecuda's resources.rs).
    "cuMemRetainAllocationHandle", "cuArrayCreate_v2", "cuArray3DCreate_v2", "cuMipmappedArrayCreate", "cuArrayDestroy",
    "cuMipmappedArrayDestroy", "cuArrayGetMemoryRequirements", "cuMipmappedArrayGetMemoryRequirements", "cuGraphCreate",
    "cuGraphAddMemAllocNode", "cuGraphInstantiateWithFlags", "cuGraphLaunch", "cuGraphLaunch_ptsz", "cuDeviceGraphMemTrim",
    "cuDeviceGetGraphMemAttribute", "cuGraphExecDestroy", "cuGraphDestroy", "cuCtxCreate_v3",
    // Graphs: capture, clones, child graphs, instantiation (fakecuda's graphs.rs).
    "cuGraphAddChildGraphNode", "cuGraphAddNode", "cuGraphAddNode_v2", "cuGraphClone", "cuGraphGetNodes", "cuGraphNodeGetType", "cuGraphMemAllocNodeGetParams",
    "cuGraphChildGraphNodeGetGraph", "cuGraphInstantiate", "cuGraphInstantiate_v2", "cuGraphInstantiateWithParams",
    "cuGraphInstantiateWithParams_ptsz", "cuGraphUpload", "cuGraphUpload_ptsz", "cuStreamBeginCapture_v2",
    "cuStreamBeginCapture_v2_ptsz", "cuStreamEndCapture", "cuStreamEndCapture_ptsz", "cuStreamIsCapturing",
    "cuStreamIsCapturing_ptsz",
];

#[test]
fn every_export_has_its_own_address() -> Result<()> {
    let node = FakeNode::new("exports");
    let out = node.workload().step(format!("dlsym {}", EXPORTS.join(" "))).run()?.success()?;
    let mut addrs = Vec::new();
    for line in out.lines("dlsym ") {
        let w: Vec<&str> = line.split_whitespace().collect();
        let addr = e2e::parse_u64(w[2]).with_context(|| line.to_string())?;
        assert_ne!(addr, 0, "{} is not exported", w[1]);
        addrs.push(addr);
    }
    assert_eq!(addrs.len(), EXPORTS.len());
    addrs.sort_unstable();
    addrs.dedup();
    assert_eq!(addrs.len(), EXPORTS.len(), "two exports share an address (merged functions double-count uprobes)");
    Ok(())
}

#[test]
fn errors_are_the_drivers() -> Result<()> {
    let node = FakeNode::new("errors");
    let cases: &[(&[&str], &str)] = &[
        (&["--no-init", "meminfo"], "error meminfo 3 CUDA_ERROR_NOT_INITIALIZED"),
        (&["alloc a 1m"], "error alloc 201 CUDA_ERROR_INVALID_CONTEXT"),
        (&["meminfo"], "error meminfo 201 CUDA_ERROR_INVALID_CONTEXT"),
        (&["ctx 0", "alloc a 1m", "free a", "free a"], "error free 1 CUDA_ERROR_INVALID_VALUE"),
        (&["ctx 0", "alloc a 0"], "error alloc 1 CUDA_ERROR_INVALID_VALUE"),
        (&["ctx 3"], "error ctx 101 CUDA_ERROR_INVALID_DEVICE"),
        (&["ctx 0", "ctx-destroy", "alloc a 1m"], "error alloc 201 CUDA_ERROR_INVALID_CONTEXT"),
    ];
    for (steps, err) in cases {
        let mut w = node.workload();
        for s in *steps {
            w = if s.starts_with("--") { w.arg(*s) } else { w.step(*s) };
        }
        let out = w.run()?;
        assert_eq!(out.code(), Some(1), "{steps:?}: {out:?}");
        assert!(out.stderr.contains(err), "{steps:?}: want {err:?}, got {:?}", out.stderr);
    }
    Ok(())
}

#[test]
fn bad_environment_values_are_reported_clearly() -> Result<()> {
    let dir = std::env::temp_dir().join("fakecuda-e2e-no-such-dir");
    let cases = [
        ("FAKECUDA_DEVICE_BYTES", "12q".to_string()),
        ("FAKECUDA_DEVICE_COUNT", "9".to_string()),
        ("FAKECUDA_CONTEXT_BYTES", "lots".to_string()),
        ("FAKECUDA_NODE", "a/b".to_string()),
        ("FAKECUDA_STATE_DIR", dir.display().to_string()),
    ];
    for (var, value) in cases {
        let node = FakeNode::new("badenv");
        let out = node.workload().env(var, &value).step("meminfo").run()?;
        assert_eq!(out.code(), Some(1), "{var}={value}: {out:?}");
        assert!(out.stdout.iter().all(|l| !l.starts_with("ready")), "{var}: {:?}", out.stdout);
        let line = out.stderr.lines().find(|l| l.starts_with("fakecuda:")).unwrap_or_default();
        assert!(line.contains(var) && line.contains(&value), "{var}={value}: {:?}", out.stderr);
        assert!(out.stderr.contains("error init 1 CUDA_ERROR_INVALID_VALUE"), "{:?}", out.stderr);
        assert!(!node.device_file(0).exists(), "nothing created on a bad configuration");
    }
    let none = FakeNode::new("nodev").with_env("FAKECUDA_DEVICE_COUNT", "0");
    let out = none.workload().step("meminfo").run()?;
    assert!(out.stderr.contains("error init 100 CUDA_ERROR_NO_DEVICE"), "{:?}", out.stderr);
    Ok(())
}

#[test]
fn device_files_are_validated_and_sized_by_their_creator() -> Result<()> {
    let node = FakeNode::new("files").with_env("FAKECUDA_DEVICE_BYTES", "1g");
    assert_eq!(node.devstat(0)?, (0, GIB));
    // A later process asking for another size gets the creator's.
    let out = node.workload().env("FAKECUDA_DEVICE_BYTES", "2g").steps(["ctx 0", "meminfo"]).run()?.success()?;
    assert_eq!(field(out.line("meminfo ")?, "total")?, GIB);

    let bad = FakeNode::new("corrupt");
    std::fs::write(bad.device_file(0), vec![0x55u8; 69632])?;
    let out = bad.workload().step("ctx 0").run()?;
    assert_eq!(out.code(), Some(1));
    assert!(out.stderr.contains("is not a valid device state file"), "{:?}", out.stderr);
    assert!(out.stderr.contains(&bad.device_file(0).display().to_string()), "{:?}", out.stderr);
    assert!(out.stderr.contains("error init 304"), "{:?}", out.stderr);
    Ok(())
}

#[test]
fn threads_stress_and_bench_leave_nothing_behind() -> Result<()> {
    let node = FakeNode::new("stress");
    let out = node
        .workload()
        .steps(["ctx 0", "stress 4 500 1m", "stress 4 200 3m", "devstat 0", "bench 2000 64k", "devstat 0"])
        .run()?
        .success()?;
    let stress: Vec<&str> = out.lines("stress ").collect();
    assert_eq!(stress, ["stress pairs=2000", "stress pairs=800"]);
    assert_eq!(devstats(&out)?, vec![CTX, CTX]);
    let bench = out.line("bench ")?;
    assert_eq!(field(bench, "pairs")?, 2000);
    let ns: f64 = bench.rsplit('=').next().unwrap_or("").parse().context("ns_per_pair")?;
    assert!(ns > 0.0, "{bench}");
    Ok(())
}

#[test]
fn device_usage_works_without_init() -> Result<()> {
    let node = FakeNode::new("standalone").with_env("FAKECUDA_DEVICE_COUNT", "2").with_env("FAKECUDA_DEVICE_BYTES", "3g");
    let mut holder = node.workload().steps(["ctx 1", "alloc a 5m", "checkpoint held"]).spawn()?;
    holder.wait_checkpoint("held")?;
    let out = node.workload().arg("--no-init").steps(["devstat 1", "devstat 0"]).run()?.success()?;
    let lines: Vec<&str> = out.lines("devstat ").collect();
    assert_eq!(lines, [format!("devstat used={} total={}", CTX + 6 * MIB, 3 * GIB), format!("devstat used=0 total={}", 3 * GIB)]);
    holder.wait()?.success()?;
    Ok(())
}

#[test]
fn nvml_reports_every_processs_memory_without_cu_init() -> Result<()> {
    let node = FakeNode::new("nvml").with_env("FAKECUDA_DEVICE_COUNT", "2").with_env("FAKECUDA_DEVICE_BYTES", "3g");
    let mut holder = node.workload().steps(["ctx 1", "alloc a 5m", "checkpoint held"]).spawn()?;
    holder.wait_checkpoint("held")?;
    // Like nvidia-smi: no cuInit, the whole device, another process's memory included.
    let out = node
        .workload()
        .arg("--no-init")
        .steps(["nvml-meminfo 1", "nvml-meminfo 0", "nvml-meminfo 1 global", "nvml-null 1", "calls nvmlDeviceGetMemoryInfo cuInit"])
        .run()?
        .success()?;
    let used = CTX + 6 * MIB;
    let lines: Vec<&str> = out.lines("nvml-meminfo ").collect();
    let line = |used: u64| {
        let free = 3 * GIB - used;
        format!("nvml-meminfo total={} free={free} used={used} v2-total={} v2-free={free} v2-used={used} v2-reserved=0", 3 * GIB, 3 * GIB)
    };
    assert_eq!(lines, [line(used), line(0), line(used)]);
    assert_eq!(out.line("nvml-null ")?, "nvml-null v1=2 v2=2 v2-version=25", "NULL: invalid argument; version 0: mismatch");
    let calls: Vec<&str> = out.lines("calls ").collect();
    assert_eq!(calls, ["calls nvmlDeviceGetMemoryInfo 4", "calls cuInit 0"], "three nvml-meminfo steps and nvml-null");
    holder.wait()?.success()?;

    // NVML's UUIDs are the driver's, device by device.
    let out = node.workload().steps(["nvml-uuid 0", "nvml-uuid 1"]).run()?.success()?;
    let uuids: Vec<(&str, &str)> = out
        .lines("nvml-uuid ")
        .filter_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            Some((w.get(1)?.strip_prefix("nvml=")?, w.get(2)?.strip_prefix("cuda=")?))
        })
        .collect();
    assert_eq!(uuids.len(), 2, "{:?}", out.stdout);
    for (nvml, cuda) in &uuids {
        assert_eq!(nvml, cuda);
        assert!(nvml.starts_with("GPU-") && nvml.len() == 40, "{nvml}");
    }
    assert_ne!(uuids[0], uuids[1]);

    // Errors are NVML's, with its description.
    let out = node.workload().arg("--no-init").step("nvml-meminfo 2").run()?;
    assert_eq!(out.code(), Some(1), "{out:?}");
    assert!(out.stderr.contains("error nvml-meminfo 2 Invalid Argument"), "{:?}", out.stderr);
    Ok(())
}

/// Kills a process (a forked child the test does not own) when dropped.
struct KillOnDrop(u32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        // SAFETY: kill(2) of a pid this test's workload forked and printed.
        unsafe { libc::kill(self.0 as libc::pid_t, libc::SIGKILL) };
    }
}

/// `nvml-procs` of device 0 from a process without `cuInit`: (pid, used) of each row.
fn nvml_procs(node: &FakeNode) -> Result<Vec<(u64, u64)>> {
    let out = node.workload().arg("--no-init").step("nvml-procs 0").run()?.success()?;
    out.lines("nvml-proc ").map(|l| Ok((field(l, "pid")?, field(l, "used")?))).collect()
}

#[test]
fn a_forked_child_keeps_its_parents_memory_until_it_closes_the_device() -> Result<()> {
    let node = FakeNode::new("fork-keeps");
    // The parent allocates, forks a child that makes no CUDA call, and _exits.
    let out = node.workload().steps(["ctx 0", "alloc a 900m", "fork-hold", "_exit 0"]).run()?.success()?;
    let parent = out.line("ready pid=").map(|l| field(l, "pid"))??;
    let child = out.line("fork-hold ").map(|l| field(l, "child"))??;
    let guard = KillOnDrop(child as u32);
    let held = CTX + 900 * MIB;
    assert_eq!(node.used(0)?, held, "the child holds the parent's open device file");
    // NVML lists the pid of the process that made the memory, as the real one does.
    assert_eq!(nvml_procs(&node)?, [(parent, held)]);
    // Another process's allocation finds the memory taken (reaping frees nothing).
    let small = node.workload().steps(["ctx 0", "devstat 0"]).run()?.success()?;
    assert_eq!(field(small.line("devstat ")?, "used")?, held + CTX);
    drop(guard);
    e2e::wait_for(e2e::timeout(), "the child's exit releases the memory", || Ok(node.used(0)? == 0))?;
    assert_eq!(nvml_procs(&node)?, []);

    // Control: without a child, the parent's _exit releases it.
    node.workload().steps(["ctx 0", "alloc a 900m", "_exit 0"]).run()?.success()?;
    assert_eq!(node.used(0)?, 0);
    Ok(())
}

#[test]
fn a_client_without_a_channel_holds_memory_nvml_does_not_list() -> Result<()> {
    let node = FakeNode::new("no-channel");
    let listed = e2e::holding(node.workload(), &["ctx 0", "alloc a 10m"])?;
    let hidden = e2e::holding(node.workload().env("FAKECUDA_NO_CHANNEL", "1"), &["ctx 0", "alloc a 100m"])?;
    let out = node.workload().arg("--no-init").steps(["nvml-procs 0", "nvml-meminfo 0"]).run()?.success()?;
    let rows: Vec<(u64, u64)> = out.lines("nvml-proc ").map(|l| Ok((field(l, "pid")?, field(l, "used")?))).collect::<Result<_>>()?;
    assert_eq!(rows, [(u64::from(listed.pid()), CTX + 10 * MIB)], "only the process with a channel is listed");
    let used = field(out.line("nvml-meminfo ")?, "used")?;
    assert_eq!(used, 2 * CTX + 110 * MIB, "the device's used memory counts both");
    drop(hidden);
    e2e::wait_for(e2e::timeout(), "the hidden client's memory is released at its exit", || Ok(node.used(0)? == CTX + 10 * MIB))?;
    drop(listed);
    Ok(())
}
