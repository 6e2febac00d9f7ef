//! Issue "Driver truth", item 4: the ledger never over-states what a stream-ordered pool
//! holds. A pool gives its reserved memory above the release threshold (0 by default) back to
//! the driver at a synchronize (`cuStreamSynchronize`, `cuEventSynchronize`,
//! `cuCtxSynchronize`). The hook settles its pool charges against what the driver reports at
//! each synchronize (so the container's other processes get the memory too) and again before
//! any refusal is final (for a release it saw no call for). Real processes, the fake driver
//! (whose pools release as the real driver documents, see `docs/gpu.md`), a 1 GiB quota and
//! 64 MiB contexts on a 4 GiB device, so any refusal is the hook's.
//!
//! Also item 6 for pools: the fake NVML's per-process figure follows the pool (and VMM and
//! the context) down at the synchronize and to nothing at exit.
//!
//! Build first: `cargo build -p hook -p fakecuda -p workload` (or `cargo xtask test`).
use anyhow::{ensure, Context, Result};
use e2e::{field, ledgers, FakeNode, Running, GIB, MIB};

const LIMIT: u64 = GIB;
const CTX: u64 = 64 * MIB;
const HELD: u64 = 700 * MIB;

fn node(tag: &str) -> FakeNode {
    FakeNode::new(tag).with_env("FAKECUDA_DEVICE_BYTES", "4g").with_env("FAKECUDA_CONTEXT_BYTES", "64m")
}

/// The program: 700 MiB from the pool, freed, and the given synchronize.
fn scenarios() -> [(&'static str, Vec<&'static str>); 4] {
    [
        ("cuStreamSynchronize (NULL stream)", vec!["async a 700m", "free-async a", "sync"]),
        ("cuStreamSynchronize (a created stream)", vec!["stream s", "async-on a 700m s", "free-async-on a s", "sync s"]),
        ("cuEventSynchronize", vec!["stream s", "async-on a 700m s", "free-async-on a s", "event-sync s"]),
        ("cuCtxSynchronize", vec!["async a 700m", "free-async a", "ctx-sync"]),
    ]
}

/// Runs `ctx 0`, `first`, a checkpoint `synced`, then `then` and a checkpoint `done` under the
/// hook; returns the running workload at `synced`.
fn spawn(node: &FakeNode, first: &[&str], then: &[&str]) -> Result<Running> {
    let ledger = node.ledger_path();
    let steps = std::iter::once("ctx 0")
        .chain(first.iter().copied())
        .chain(["checkpoint synced"])
        .chain(then.iter().copied())
        .chain(["checkpoint done"]);
    let mut w = node.hooked(&ledger, LIMIT)?.steps(steps).spawn()?;
    w.wait_checkpoint("synced")?;
    Ok(w)
}

#[test]
fn after_a_synchronize_the_pools_memory_is_granted_again() -> Result<()> {
    for (how, first) in scenarios() {
        let node = node("pool-sync");
        let ledger = node.ledger_path();
        let mut w = spawn(&node, &first, &["alloc b 700m"])?;
        assert_eq!(node.used(0)?, CTX, "{how}: the driver took the pool's memory back");
        assert_eq!(ledgers::used(&ledger)?, CTX, "{how}: and the hook's charge follows at the synchronize");
        w.resume()?;
        w.wait_checkpoint("done")?;
        assert_eq!(ledgers::used(&ledger)?, CTX + HELD, "{how}: the ledger charges what the driver holds, once");
        assert_eq!(node.used(0)?, CTX + HELD, "{how}: the driver holds the new allocation");
        w.resume()?;
        let out = w.wait()?.success()?;
        out.line("ok alloc b ").with_context(|| format!("{how}: the second 700 MiB is granted"))?;
        ensure!(!out.stderr.contains("quota exceeded"), "{how}: nothing was refused: {}", out.stderr);
        assert_eq!(ledgers::used(&ledger)?, 0, "{how}: all released at exit");
    }
    Ok(())
}

/// The container's other processes cannot settle this one's pools: the synchronize itself
/// gives the quota back, so another process's allocation is granted after it, and refused
/// while the pool still holds the memory (no synchronize).
#[test]
fn after_a_synchronize_another_process_of_the_container_is_granted() -> Result<()> {
    for (synchronized, first) in [(true, vec!["async a 700m", "free-async a", "sync"]), (false, vec!["async a 700m", "free-async a"])] {
        let node = node("pool-sync-peer");
        let ledger = node.ledger_path();
        let holder = spawn(&node, &first, &[])?;
        let other = node.hooked(&ledger, LIMIT)?.steps(["ctx 0", "alloc b 700m"]).run()?;
        if synchronized {
            other.success()?.line("ok alloc b ")?;
        } else {
            assert_eq!(other.code(), Some(1), "refused while the pool holds it: {other:?}");
            ensure!(other.stderr.contains("error alloc 2 CUDA_ERROR_OUT_OF_MEMORY"), "{}", other.stderr);
        }
        holder.wait()?.success()?;
    }
    Ok(())
}

/// A release the hook sees no call for (here the fake's `FAKECUDA_FREE_SYNCHRONIZES`: a
/// `cuMemFree_v2` that releases the pools): the ledger still charges the pool until an
/// admission is refused; the refusal path then settles every pool and tries again, so the
/// allocation is granted, by `cuMemAlloc` and by a new pool alike (whose refusal settles the
/// other pools under the pool lock it holds). Without the knob the pool keeps its memory and
/// both are refused.
#[test]
fn a_release_the_hook_did_not_see_is_settled_before_a_refusal() -> Result<()> {
    let steps = ["async a 700m", "free-async a", "alloc x 2m", "free x"];
    for (second, name) in [(vec!["alloc b 700m"], "ok alloc b "), (vec!["mempool p", "mempool-alloc b 700m p"], "ok mempool-alloc b ")] {
        let unseen = node("pool-unseen").with_env("FAKECUDA_FREE_SYNCHRONIZES", "1");
        let ledger = unseen.ledger_path();
        let mut w = spawn(&unseen, &steps, &second)?;
        assert_eq!(unseen.used(0)?, CTX, "{name}: the driver took the pool's memory back");
        assert_eq!(ledgers::used(&ledger)?, CTX + HELD, "{name}: the hook has not seen it yet");
        w.resume()?;
        w.wait_checkpoint("done")?;
        assert_eq!(ledgers::used(&ledger)?, CTX + HELD, "{name}: settled, then charged for the new allocation");
        assert_eq!(unseen.used(0)?, CTX + HELD, "{name}");
        w.resume()?;
        w.wait()?.success()?.line(name)?;

        let kept = node("pool-unseen-kept");
        let expect_oom: Vec<String> = second.iter().map(|s| if s.contains("alloc") { format!("expect-oom {s}") } else { s.to_string() }).collect();
        let expect_oom: Vec<&str> = expect_oom.iter().map(String::as_str).collect();
        let out = spawn(&kept, &steps, &expect_oom)?.wait()?.success()?;
        assert_eq!(out.lines("oom ").collect::<Vec<_>>(), ["oom b"], "{name}: refused while the pool keeps it");
    }
    Ok(())
}

/// Negative controls: where the driver keeps the pool's memory, so does the ledger, and the
/// second allocation is refused; a trim then gives it back and the allocation is granted.
#[test]
fn while_the_pool_keeps_its_memory_the_allocation_is_refused() -> Result<()> {
    let kept: [(&str, Vec<&str>); 3] = [
        ("no synchronize", vec!["async a 700m", "free-async a"]),
        ("release threshold 1 GiB, cuStreamSynchronize", vec!["pool-threshold 1g", "async a 700m", "free-async a", "sync"]),
        ("release threshold 1 GiB, cuCtxSynchronize", vec!["pool-threshold 1g", "async a 700m", "free-async a", "ctx-sync"]),
    ];
    for (how, first) in kept {
        let node = node("pool-kept");
        let ledger = node.ledger_path();
        let mut w = spawn(&node, &first, &["pool-stat", "expect-oom alloc b 700m", "trim 0", "alloc c 700m"])?;
        assert_eq!(node.used(0)?, CTX + HELD, "{how}: the driver still holds the pool's memory");
        w.resume()?;
        w.wait_checkpoint("done")?;
        assert_eq!(ledgers::used(&ledger)?, CTX + HELD, "{how}: after the trim, only the new allocation");
        w.resume()?;
        let out = w.wait()?.success()?;
        assert_eq!(out.line("pool-stat ")?, format!("pool-stat reserved={HELD} used=0"), "{how}");
        assert_eq!(out.lines("oom ").collect::<Vec<_>>(), ["oom b"], "{how}: refused while the pool held it");
        ensure!(
            out.stderr.contains(&format!("{} of {LIMIT} bytes in use", CTX + HELD)),
            "{how}: the refusal reports the pool's memory as in use: {}",
            out.stderr
        );
        out.line("ok alloc c ").with_context(|| format!("{how}: granted after the trim"))?;
    }
    Ok(())
}

/// A pool whose free part is in pieces: 900 MiB taken in three allocations, the first and the
/// last freed (the pool keeps them: threshold 1 GiB), so 600 MiB are free in two pieces of
/// 300. 400 MiB fit by sum but in no piece: the driver grows the pool by 100 MiB, past the
/// quota (64 MiB of context + 900 MiB of pool + 100 > 1 GiB). Measured on an H200 with a
/// PyTorch `cudaMallocAsync` job: such growths passed the quota by 64 MiB a time until the
/// probes stopped it. The hook gives that growth back with the pool's free pieces and tries
/// again: the pool grows afresh by the 400 MiB, which the quota holds (granted; the device
/// holds 64 + 300 + 400 MiB). 300 MiB more do not fit: refused. The device ends at most at
/// the quota, nothing is left uncharged, the process goes on. The fake keeps stream-ordered
/// frees from a trim until a synchronize (`FAKECUDA_TRIM_OBSERVED`), as the H200 did: a give-back
/// that trimmed after `cuStreamQuery` alone left the growth in the pool and let the process
/// take it again, uncharged (it was stopped). Once more with the stream busy past the hook's
/// poll (`FAKECUDA_STREAM_BUSY_MS`): the hook then waits for it in a synchronize.
#[test]
fn a_pool_whose_free_part_is_in_pieces_grows_afresh_within_the_quota() -> Result<()> {
    // The last: its stream still busy 600 ms after each free, past the hook's 200 ms poll.
    for (alloc, free, busy_ms) in [("async", "free-async", "0"), ("async-ptsz", "free-async-ptsz", "0"), ("async", "free-async", "600")] {
        // As on the H200: a trim keeps what a stream-ordered free released until a synchronize.
        let node = node("pool-pieces").with_env("FAKECUDA_TRIM_OBSERVED", "1").with_env("FAKECUDA_STREAM_BUSY_MS", busy_ms);
        let ledger = node.ledger_path();
        let first = [
            "pool-threshold 1g".to_string(),
            format!("{alloc} a 300m"),
            format!("{alloc} b 300m"),
            format!("{alloc} c 300m"),
            format!("{free} a"),
            format!("{free} c"),
        ];
        let then = [format!("{alloc} d 400m"), "checkpoint granted".into(), format!("expect-oom {alloc} e 300m"), "pool-stat".into()];
        let first: Vec<&str> = first.iter().map(String::as_str).collect();
        let then: Vec<&str> = then.iter().map(String::as_str).collect();
        let mut w = spawn(&node, &first, &then)?;
        assert_eq!(node.used(0)?, CTX + 900 * MIB, "{alloc}: the pool keeps what was freed");
        w.resume()?;
        w.wait_checkpoint("granted")?;
        assert_eq!(node.used(0)?, CTX + 700 * MIB, "{alloc}: the pool's pieces given back, 400 MiB grown afresh");
        assert_eq!(ledgers::used(&ledger)?, CTX + 700 * MIB, "{alloc}: the ledger charges what the pool holds");
        w.resume()?;
        w.wait_checkpoint("done")?;
        assert_eq!(node.used(0)?, CTX + 700 * MIB, "{alloc}: nothing grown for the refused allocation");
        w.resume()?;
        let out = w.wait()?.success()?;
        assert_eq!(out.lines("oom ").collect::<Vec<_>>(), ["oom e"], "{alloc}: only what the quota cannot hold is refused");
        assert_eq!(out.line("pool-stat ")?, format!("pool-stat reserved={} used={}", 700 * MIB, 700 * MIB));
        ensure!(!out.stderr.contains("more than the ledger could charge"), "{alloc}: nothing left uncharged: {}", out.stderr);
    }
    Ok(())
}

/// A pool whose free pieces share pages with live allocations: 1 MiB pieces beside 1 MiB
/// allocations in one 2 MiB page each, the rest of the quota taken. 2 MiB fit by sum in no
/// piece: the driver grows the pool past the quota; the hook gives the growth back, but giving
/// the free part back releases nothing more (no page is wholly free), so the allocation is
/// refused and the hook says why. The device never ends above the quota, and the process goes
/// on: once memory is freed, what fits is granted.
#[test]
fn a_growth_past_the_quota_that_giving_back_cannot_make_room_for_is_refused() -> Result<()> {
    let node = node("pool-shared-pages").with_env("FAKECUDA_TRIM_OBSERVED", "1");
    let ledger = node.ledger_path();
    let first = [
        "pool-threshold 1g",
        "async a 300m",
        "async x 1m",
        "async b 1m",
        "async c 300m",
        "async y 1m",
        "async d 1m",
        "free-async x",
        "free-async y",
        "async e 356m",
    ];
    let mut w = spawn(&node, &first, &["expect-oom async f 2m", "checkpoint refused", "free-async e", "async g 2m", "pool-stat"])?;
    assert_eq!(node.used(0)?, LIMIT, "the quota taken: 960 MiB in the pool, 2 MiB of it free in pieces");
    w.resume()?;
    w.wait_checkpoint("refused")?;
    assert_eq!(node.used(0)?, LIMIT, "the growth given back");
    assert_eq!(ledgers::used(&ledger)?, LIMIT, "the ledger charges what the pool holds");
    w.resume()?;
    w.wait_checkpoint("done")?;
    w.resume()?;
    let out = w.wait()?.success()?;
    assert_eq!(out.lines("oom ").collect::<Vec<_>>(), ["oom f"], "refused: {}", out.stderr);
    ensure!(
        out.stderr.contains(&format!("a memory pool would grow past it for {} bytes", 2 * MIB)),
        "the hook says why: {}",
        out.stderr
    );
    ensure!(!out.stderr.contains("more than the ledger could charge"), "nothing left uncharged: {}", out.stderr);
    out.line("ok async g ").with_context(|| format!("granted once memory was freed: {:?}", out.stdout))?;
    assert_eq!(out.line("pool-stat ")?, format!("pool-stat reserved={} used={}", 960 * MIB, 604 * MIB));
    Ok(())
}

/// A driver that keeps a growth the hook gave back (`FAKECUDA_TRIM_KEEPS`: its trim releases
/// nothing): the pool then holds 2 MiB its charge cannot (the quota is full). Of what the pool
/// keeps free, only the charged part (two 1 MiB pieces) serves without an admission: 3 MiB
/// more goes to the ledger first and is refused there, so the pool does not grow again past
/// the quota. Without that rule the uncharged 2 MiB counted as free, the driver was asked and
/// grew the pool again (2 MiB more), which it kept too.
#[test]
fn a_growth_the_driver_keeps_serves_nothing_uncharged() -> Result<()> {
    let node = node("pool-keeps").with_env("FAKECUDA_TRIM_KEEPS", "1");
    let ledger = node.ledger_path();
    let first =
        ["pool-threshold 1g", "async a 300m", "async x 1m", "async b 1m", "async c 300m", "async y 1m", "async d 1m", "async e 356m", "free-async x", "free-async y"];
    let mut w = spawn(&node, &first, &["expect-oom async f 2m", "checkpoint kept", "expect-oom async g 3m"])?;
    assert_eq!(node.used(0)?, LIMIT, "the quota taken: 960 MiB in the pool, 2 MiB of it free in pieces");
    w.resume()?;
    w.wait_checkpoint("kept")?;
    assert_eq!(node.used(0)?, LIMIT + 2 * MIB, "the driver kept the growth the hook gave back");
    assert_eq!(ledgers::used(&ledger)?, LIMIT, "the quota's full");
    w.resume()?;
    w.wait_checkpoint("done")?;
    assert_eq!(node.used(0)?, LIMIT + 2 * MIB, "no new growth: the 3 MiB were refused by the ledger, not given back by the driver");
    w.resume()?;
    let out = w.wait()?.success()?;
    assert_eq!(out.lines("oom ").collect::<Vec<_>>(), ["oom f", "oom g"], "{}", out.stderr);
    ensure!(
        out.stderr.contains(&format!("GPU memory quota exceeded on device 0: {} bytes requested", 4 * MIB)),
        "g refused at its admission (its growth, 4 MiB: two pages): {}",
        out.stderr
    );
    Ok(())
}

/// What NVML says `pid` uses on device 0 (`None`: not listed), asked by a process of its own
/// that never initialises the driver (as `nvidia-smi`).
fn nvml_used(node: &FakeNode, pid: u32) -> Result<Option<u64>> {
    let out = node.workload().arg("--no-init").step("nvml-procs 0").run()?.success()?;
    for line in out.lines("nvml-proc ") {
        if field(line, "pid")? == u64::from(pid) {
            return Ok(Some(field(line, "used")?));
        }
    }
    Ok(None)
}

/// The fake driver alone: a pool's reserved memory shows in `cuMemPoolGetAttribute` and in
/// NVML's per-process figure (with the context and a VMM allocation) until the synchronize
/// releases it, or, with a release threshold above it, past the synchronize; and the process
/// is gone from NVML when it exits.
#[test]
fn nvml_per_process_memory_drops_at_the_synchronize_and_at_exit() -> Result<()> {
    for (threshold, after_sync) in [("0", 0), ("1g", HELD)] {
        let node = node("pool-nvml");
        let mut w = node
            .workload()
            .steps([
                "ctx 0".to_string(),
                "vmm v 6m".to_string(),
                format!("pool-threshold {threshold}"),
                "async a 700m".to_string(),
                "free-async a".to_string(),
                "pool-stat".to_string(),
                "checkpoint freed".to_string(),
                "sync".to_string(),
                "pool-stat".to_string(),
                "checkpoint synced".to_string(),
            ])
            .spawn()?;
        let pid = w.pid();
        w.wait_checkpoint("freed")?;
        let base = CTX + 6 * MIB;
        assert_eq!(nvml_used(&node, pid)?, Some(base + HELD), "threshold {threshold}: freed, still reserved by the pool");
        w.resume()?;
        w.wait_checkpoint("synced")?;
        assert_eq!(nvml_used(&node, pid)?, Some(base + after_sync), "threshold {threshold}: after the synchronize");
        assert_eq!(node.used(0)?, base + after_sync, "threshold {threshold}: the device agrees");
        w.resume()?;
        let out = w.wait()?.success()?;
        let stats: Vec<&str> = out.lines("pool-stat ").collect();
        assert_eq!(stats, [format!("pool-stat reserved={HELD} used=0"), format!("pool-stat reserved={after_sync} used=0")]);
        assert_eq!(nvml_used(&node, pid)?, None, "threshold {threshold}: nothing is held after exit");
        assert_eq!(node.used(0)?, 0, "threshold {threshold}: the device is empty");
    }
    Ok(())
}
