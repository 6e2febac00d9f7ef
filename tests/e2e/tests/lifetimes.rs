//! Allocation lifetimes as the driver has them (issue 11, item 1), with `libvramguard.so`
//! preloaded into `fakecuda-workload` processes over the fake driver: VMM handles stay charged
//! while mapped, host-located VMM memory is not charged, arrays, graph memory and every kind of
//! context are charged for as long as the driver holds them, and refused over the quota.
//!
//! Each test compares the ledger with the driver's own counter of what the device holds
//! ([`FakeNode::used`], read by an un-hooked process): the hook's context reserve equals what
//! the fake charges per context, so the two must agree byte for byte at every checkpoint.
//!
//! Build first: `cargo build -p hook -p fakecuda -p workload` (or `cargo xtask test`).
use std::path::Path;

use anyhow::{ensure, Result};
use e2e::{ledgers, FakeNode, Running, GIB, MIB};
use ledger::{Kind, Ledger};

const LIMIT: u64 = GIB;
const CTX: u64 = 64 * MIB;

/// A node with an 8 GiB device and contexts of `context` bytes.
fn node(tag: &str, context: &str) -> FakeNode {
    FakeNode::new(tag).with_env("FAKECUDA_DEVICE_BYTES", "8g").with_env("FAKECUDA_CONTEXT_BYTES", context)
}

/// Bytes the ledger's live slots hold on device 0: (data and small allocations, contexts).
fn kinds(path: &Path) -> Result<(u64, u64)> {
    let ledger = Ledger::open(path)?;
    Ok(ledger.slots()?.iter().fold((0, 0), |(data, context), view| {
        let bytes = view.slot.devices[0].bytes;
        (data + bytes[Kind::Data as usize] + bytes[Kind::Small as usize], context + bytes[Kind::Context as usize])
    }))
}

/// At checkpoint `name`: the ledger charges `expected` bytes, exactly what the driver holds,
/// and every invariant of the ledger holds; then the workload goes on. Returns what the
/// ledger's slots held there, by kind ([`kinds`]).
fn at(w: &mut Running, name: &str, node: &FakeNode, ledger: &Path, expected: u64) -> Result<(u64, u64)> {
    w.wait_checkpoint(name)?;
    let charged = ledgers::used(ledger)?;
    let held = node.used(0)?;
    ensure!(charged == expected, "{name}: the ledger charges {} MiB, expected {} MiB", charged / MIB, expected / MIB);
    ensure!(held == expected, "{name}: the driver holds {} MiB, expected {} MiB", held / MIB, expected / MIB);
    let problems = Ledger::open(ledger)?.check()?;
    ensure!(problems.is_empty(), "{name}: ledger check: {problems:?}");
    let by_kind = kinds(ledger)?;
    w.resume()?;
    Ok(by_kind)
}

/// The case: six 1 GiB VMM handles, each created, mapped and released while still
/// mapped, under a 1 GiB quota. The driver keeps released-but-mapped memory, so the hook must
/// too: the first handle fills the quota (no context reserve here, so exactly one fits) and
/// the five others are refused; unmapping the first gives the quota back.
#[test]
fn released_but_mapped_vmm_memory_stays_charged_until_unmapped() -> Result<()> {
    let node = node("vmm-mapped", "0");
    let ledger = node.ledger_path();
    let mut steps = vec!["ctx 0".to_string()];
    for i in 1..=6 {
        // The first fits; the hook refuses the others before the driver is called.
        let create = if i == 1 { format!("vmm v{i} 1g") } else { format!("expect-oom vmm v{i} 1g") };
        steps.push(create);
        if i == 1 {
            steps.push(format!("release v{i}"));
        }
    }
    steps.extend(["checkpoint released", "unmap v1", "checkpoint unmapped", "vmm w 1g", "checkpoint again", "vmm-free w"].map(String::from));
    let mut w = node.hooked(&ledger, LIMIT)?.steps(steps).spawn()?;
    let by_kind = at(&mut w, "released", &node, &ledger, GIB)?;
    assert_eq!(by_kind, (GIB, 0), "the released, still mapped handle is charged as data");
    at(&mut w, "unmapped", &node, &ledger, 0)?;
    at(&mut w, "again", &node, &ledger, GIB)?;
    let out = w.wait()?.success()?;
    assert_eq!(out.lines("oom ").collect::<Vec<_>>(), ["oom v2", "oom v3", "oom v4", "oom v5", "oom v6"]);
    assert_eq!(ledgers::used(&ledger)?, 0, "nothing charged after the process exits");

    // Negative control: without the hook the same six handles all succeed and the device
    // holds 6 GiB for one process (the overshoot the hook prevents).
    let mut steps: Vec<String> = (1..=6).flat_map(|i| [format!("vmm v{i} 1g"), format!("release v{i}")]).collect();
    steps.insert(0, "ctx 0".into());
    steps.push("checkpoint held".into());
    let mut w = node.workload().steps(steps).spawn()?;
    w.wait_checkpoint("held")?;
    assert_eq!(node.used(0)?, 6 * GIB, "un-hooked, the released handles stay held by the driver");
    w.resume()?;
    w.wait()?.success()?;
    Ok(())
}

/// `cuMemRetainAllocationHandle` is one more reference: the memory stays charged after the
/// creator's release and the unmap, until that reference is released too.
#[test]
fn a_retained_vmm_handle_stays_charged_until_its_last_reference_goes() -> Result<()> {
    let node = node("vmm-retain", "64m");
    let ledger = node.ledger_path();
    let mut w = node
        .hooked(&ledger, LIMIT)?
        .steps(["ctx 0", "vmm v 256m", "retain v", "release v", "unmap v", "checkpoint retained", "release v", "checkpoint gone"])
        .spawn()?;
    at(&mut w, "retained", &node, &ledger, CTX + 256 * MIB)?;
    at(&mut w, "gone", &node, &ledger, CTX)?;
    w.wait()?.success()?;
    Ok(())
}

/// Host-located VMM memory (`CU_MEM_LOCATION_TYPE_HOST`) is the host's RAM: not charged, even
/// past the GPU quota; device-located memory next to it still is.
#[test]
fn host_located_vmm_memory_is_not_charged() -> Result<()> {
    let node = node("vmm-host", "64m");
    let ledger = node.ledger_path();
    let mut w = node
        .hooked(&ledger, LIMIT)?
        .steps(["ctx 0", "create-host h 2g", "checkpoint host", "expect-oom create d 1g", "create d 512m", "checkpoint device", "release h", "release d"])
        .spawn()?;
    at(&mut w, "host", &node, &ledger, CTX)?;
    at(&mut w, "device", &node, &ledger, CTX + 512 * MIB)?;
    let out = w.wait()?.success()?;
    assert_eq!(out.lines("oom ").collect::<Vec<_>>(), ["oom d"]);
    Ok(())
}

/// Arrays are charged what the driver says they take (`cuArrayGetMemoryRequirements`): for the
/// 3D mipmap the hook's estimate (320 MiB, depth kept at every level) is settled to the
/// driver's 288 MiB; an array past the quota is refused; destroying gives it all back.
#[test]
fn arrays_are_charged_by_their_real_footprint_and_refused_over_quota() -> Result<()> {
    let node = node("arrays", "64m");
    let ledger = node.ledger_path();
    let mut w = node
        .hooked(&ledger, LIMIT)?
        .steps([
            "ctx 0",
            // float4: 1000 x 1000 -> 16 MiB; 512 x 512 x 100 -> 400 MiB; mipmap 256³ x 2 levels -> 288 MiB.
            "array a 1000 1000 0",
            "array b 512 512 100",
            "mipmap m 256 256 256 2",
            "checkpoint created",
            "expect-oom array c 1024 1024 64",
            "expect-oom mipmap n 1024 1024 16 3",
            "array-destroy a",
            "mipmap-destroy m",
            "checkpoint some",
            "array-destroy b",
            "checkpoint none",
        ])
        .spawn()?;
    at(&mut w, "created", &node, &ledger, CTX + 704 * MIB)?;
    at(&mut w, "some", &node, &ledger, CTX + 400 * MIB)?;
    at(&mut w, "none", &node, &ledger, CTX)?;
    let out = w.wait()?.success()?;
    assert_eq!(out.lines("oom ").collect::<Vec<_>>(), ["oom c", "oom n"]);
    Ok(())
}

/// Graph memory is held from a graph's launch (not its instantiation) in the device's graph
/// pool, which keeps it for later launches until `cuDeviceGraphMemTrim`. A launch whose graph
/// needs more than the quota leaves is refused before the driver runs it.
#[test]
fn graph_memory_is_charged_from_launch_until_trimmed_and_refused_over_quota() -> Result<()> {
    let node = node("graphs", "64m");
    let ledger = node.ledger_path();
    let mut w = node
        .hooked(&ledger, LIMIT)?
        .steps([
            "ctx 0",
            "graph g 512m",
            "checkpoint instantiated",
            "launch g",
            "checkpoint launched",
            // The pool keeps it after the launch: a plain allocation cannot take it.
            "expect-oom alloc x 600m",
            "launch g",
            "graph h 1g",
            "expect-oom launch h",
            "checkpoint refused",
            "graph-trim",
            "checkpoint trimmed",
            "alloc x 600m",
            "expect-oom launch g",
            "free x",
            "launch g",
            "graph-destroy g",
            "graph-destroy h",
            "checkpoint destroyed",
            "graph-trim",
            "checkpoint end",
        ])
        .spawn()?;
    at(&mut w, "instantiated", &node, &ledger, CTX)?;
    at(&mut w, "launched", &node, &ledger, CTX + 512 * MIB)?;
    at(&mut w, "refused", &node, &ledger, CTX + 512 * MIB)?;
    at(&mut w, "trimmed", &node, &ledger, CTX)?;
    // Destroying the graphs leaves their memory in the pool until it is trimmed.
    at(&mut w, "destroyed", &node, &ledger, CTX + 512 * MIB)?;
    at(&mut w, "end", &node, &ledger, CTX)?;
    let out = w.wait()?.success()?;
    assert_eq!(out.lines("oom ").collect::<Vec<_>>(), ["oom x", "oom launch", "oom launch"]);
    Ok(())
}

/// A graph whose allocation node came from stream capture (`graph-capture`) or sits in a child
/// graph (`graph-child`: moved into a child graph node with `cuGraphAddNode_v2`),
/// instantiated through `cuGraphInstantiateWithParams` and `cuGraphInstantiate_v2`:
/// the hook reads the executable graph's bytes from the driver's graph at instantiation, so
/// a launch (or upload) that would pass the quota is refused before the driver runs it (the
/// driver's usage does not move), and one that fits is charged from its launch until
/// `cuDeviceGraphMemTrim`. Capturing a graph bigger than the quota is not refused: captured
/// allocations take no memory until launch.
fn graph_memory_admitted_before_launch(how: &str) -> Result<()> {
    let node = node(&format!("graphs-{how}"), "64m");
    let ledger = node.ledger_path();
    let mut w = node
        .hooked(&ledger, LIMIT)?
        .steps([
            "ctx 0".to_string(),
            format!("graph-{how} g 512m"),
            format!("graph-{how} h 1g"),
            "checkpoint instantiated".to_string(),
            "expect-oom launch h".to_string(),
            "expect-oom upload h".to_string(),
            "checkpoint refused".to_string(),
            "launch g".to_string(),
            "checkpoint launched".to_string(),
            "launch g".to_string(),
            "expect-oom launch h".to_string(),
            "checkpoint relaunched".to_string(),
            "graph-trim".to_string(),
            "checkpoint trimmed".to_string(),
            "graph-destroy g".to_string(),
            "graph-destroy h".to_string(),
        ])
        .spawn()?;
    at(&mut w, "instantiated", &node, &ledger, CTX)?;
    at(&mut w, "refused", &node, &ledger, CTX)?;
    at(&mut w, "launched", &node, &ledger, CTX + 512 * MIB)?;
    at(&mut w, "relaunched", &node, &ledger, CTX + 512 * MIB)?;
    at(&mut w, "trimmed", &node, &ledger, CTX)?;
    let out = w.wait()?.success()?;
    assert_eq!(out.lines("oom ").collect::<Vec<_>>(), ["oom launch", "oom upload", "oom launch"]);
    assert!(!out.stderr.contains("cannot tell what an executable graph allocates"), "{}", out.stderr);
    Ok(())
}

#[test]
fn captured_graph_memory_is_admitted_before_launch() -> Result<()> {
    graph_memory_admitted_before_launch("capture")
}

/// A graph holding allocation nodes cannot be cloned (the real driver says
/// `CUDA_ERROR_NOT_SUPPORTED`, measured on an H100 with driver 580.159, and so does the fake):
/// the hook hands the driver's answer back.
#[test]
fn cloning_graph_memory_is_refused_by_the_driver() -> Result<()> {
    let node = node("graphs-clone", "64m");
    let ledger = node.ledger_path();
    let out = node.hooked(&ledger, LIMIT)?.steps(["ctx 0", "graph-clone c 512m"]).run()?;
    ensure!(!out.status.success(), "the clone was not refused: {:?}", out.stdout);
    assert!(out.stderr.contains("error graph-clone 801 CUDA_ERROR_NOT_SUPPORTED"), "{}", out.stderr);
    Ok(())
}

#[test]
fn child_graph_memory_is_admitted_before_launch() -> Result<()> {
    graph_memory_admitted_before_launch("child")
}

/// The negative control: without the hook the same launches reach the driver, which has the
/// memory (8 GiB) and takes it.
#[test]
fn without_the_hook_graph_launches_past_the_quota_take_device_memory() -> Result<()> {
    for how in ["capture", "child"] {
        let node = node(&format!("graphs-{how}-unhooked"), "64m");
        let out = node
            .workload()
            .steps(["ctx 0".to_string(), format!("graph-{how} h 1g"), "launch h".to_string(), "devstat 0".to_string()])
            .run()?
            .success()?;
        assert_eq!(e2e::field(out.line("devstat ")?, "used")?, CTX + GIB, "{how}: the driver ran the launch");
    }
    Ok(())
}

/// Every context holds memory: the primary one and each created one (`cuCtxCreate_v2/_v3/_v4`)
/// is charged until it is released or destroyed, and one past the quota is refused.
#[test]
fn every_context_is_charged_until_destroyed_and_refused_over_quota() -> Result<()> {
    let node = node("contexts", "64m");
    let ledger = node.ledger_path();
    let mut w = node
        .hooked(&ledger, LIMIT)?
        .steps([
            "ctx 0",
            "ctx 0",
            "ctx-create 0",
            "ctx-create-v3 0",
            "ctx-create-v4 0",
            "checkpoint four",
            "ctx-destroy",
            "ctx-destroy",
            "checkpoint two",
            "ctx-destroy",
            "checkpoint primary",
            "ctx-destroy",
            "checkpoint primary-still-retained",
            "ctx-destroy",
            "checkpoint none",
        ])
        .spawn()?;
    let by_kind = at(&mut w, "four", &node, &ledger, 4 * CTX)?;
    assert_eq!(by_kind, (0, 4 * CTX), "charged as contexts");
    at(&mut w, "two", &node, &ledger, 2 * CTX)?;
    at(&mut w, "primary", &node, &ledger, CTX)?;
    // The primary context was retained twice: one release keeps it.
    at(&mut w, "primary-still-retained", &node, &ledger, CTX)?;
    at(&mut w, "none", &node, &ledger, 0)?;
    w.wait()?.success()?;

    // 300 MiB contexts: three fit in 1 GiB, a fourth of any kind does not.
    let node = self::node("contexts-over", "300m");
    let ledger = node.ledger_path();
    let out = node
        .hooked(&ledger, LIMIT)?
        .steps(["ctx 0", "ctx-create 0", "ctx-create-v3 0", "expect-oom ctx-create-v4 0", "expect-oom ctx-create 0", "devstat 0"])
        .run()?
        .success()?;
    assert_eq!(out.lines("oom ").collect::<Vec<_>>(), ["oom ctx-create-v4", "oom ctx-create"]);
    assert_eq!(e2e::field(out.line("devstat ")?, "used")?, 900 * MIB, "the driver holds the three admitted contexts");
    Ok(())
}

// ---- destroyed memory pools (cuMemPoolDestroy) ---------------------------------------------

/// A pool from `cuMemPoolCreate` keeps freed memory reserved (and charged); `cuMemPoolDestroy`
/// of the emptied pool gives it all back, to the driver and to the ledger, so the whole quota
/// can be allocated again. Control: without the destroy, the pool's reserve stays charged and
/// the same full-quota allocation is refused.
#[test]
fn destroying_an_emptied_pool_releases_its_charge() -> Result<()> {
    let node = node("pool-destroy", "0");
    let ledger = node.ledger_path();
    let fill = |destroy: bool| {
        let mut steps = vec!["ctx 0", "mempool p", "mempool-alloc a 256m p", "mempool-alloc b 256m p", "free-async a", "free-async b"];
        steps.push("checkpoint freed");
        if destroy {
            steps.extend(["mempool-destroy p", "checkpoint destroyed", "alloc x 1g", "checkpoint full", "free x"]);
        } else {
            steps.extend(["expect-oom alloc x 1g", "checkpoint kept"]);
        }
        steps
    };
    let mut w = node.hooked(&ledger, LIMIT)?.steps(fill(true)).spawn()?;
    // Freed memory stays in the pool, charged, until the pool goes.
    at(&mut w, "freed", &node, &ledger, 512 * MIB)?;
    at(&mut w, "destroyed", &node, &ledger, 0)?;
    at(&mut w, "full", &node, &ledger, GIB)?;
    let out = w.wait()?.success()?;
    assert_eq!(out.lines("oom ").count(), 0, "nothing refused once the pool is destroyed");

    let mut w = node.hooked(&ledger, LIMIT)?.steps(fill(false)).spawn()?;
    at(&mut w, "freed", &node, &ledger, 512 * MIB)?;
    at(&mut w, "kept", &node, &ledger, 512 * MIB)?;
    let out = w.wait()?.success()?;
    assert_eq!(out.lines("oom ").collect::<Vec<_>>(), ["oom x"], "the undestroyed pool's reserve still counts");
    Ok(())
}

/// A pool destroyed while allocations from it are live: the driver gives the free part back at
/// once and the rest when the last of them is freed (`cuMemFreeAsync` or `cuMemFree_v2`); the
/// ledger follows, never charging less than the driver holds, so the quota is only usable
/// again once the last one is freed.
#[test]
fn a_pool_destroyed_with_live_allocations_stays_charged_until_they_are_freed() -> Result<()> {
    let node = node("pool-destroy-live", "0");
    let ledger = node.ledger_path();
    let mut w = node
        .hooked(&ledger, LIMIT)?
        .steps([
            "ctx 0",
            "mempool p",
            "mempool-alloc a 256m p",
            "mempool-alloc b 256m p",
            "mempool-alloc c 100m p",
            "free-async b",
            "mempool-destroy p",
            "checkpoint destroyed",
            "expect-oom alloc x 1g",
            "free-async a",
            "checkpoint one-left",
            "free c",
            "checkpoint none-left",
            "alloc x 1g",
            "checkpoint full",
            "free x",
        ])
        .spawn()?;
    // b's 256 MiB went back with the destroy; a and c still hold theirs.
    at(&mut w, "destroyed", &node, &ledger, 356 * MIB)?;
    // The pool's remaining memory stays until its last allocation goes.
    at(&mut w, "one-left", &node, &ledger, 356 * MIB)?;
    at(&mut w, "none-left", &node, &ledger, 0)?;
    at(&mut w, "full", &node, &ledger, GIB)?;
    let out = w.wait()?.success()?;
    assert_eq!(out.lines("oom ").collect::<Vec<_>>(), ["oom x"], "refused only while the destroyed pool's allocations lived");
    Ok(())
}
