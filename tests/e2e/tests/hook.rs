//! The hook (issue "The hook", Must show) against the fake driver: `libvramguard.so` preloaded
//! into `fakecuda-workload` processes that share one ledger and one fake device.
//!
//! The fake device is 4 GiB and every quota 1 GiB, so any refusal below 1 GiB is the hook's;
//! the hook's context reserve equals what the fake charges per context, so the ledger and the
//! driver's own counter ([`FakeNode::used`], an un-hooked process) must agree byte for byte.
//! NVML's memory queries (the fake driver is a fake NVML too) must show what
//! `cuMemGetInfo_v2` shows.
//!
//! Build first: `cargo build -p hook -p fakecuda -p workload` (or `cargo xtask test`).
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use e2e::{field, parse_u64, FakeNode, Running, Via, Workload, GIB, MIB};
use ledger::{layout::{DeviceConfig, Header}, Kind, Ledger};

const LIMIT: u64 = GIB;
const CTX: u64 = 64 * MIB;
/// Size each `fill` thread allocates: contexts and fills are powers of two of whole chunks,
/// so the quota fills exactly, without fragmentation.
const FILL: u64 = 4 * MIB;
const PROCESSES: u64 = 8;
const THREADS: u64 = 4;
/// Rounds of fill + free-fill each process races through before the fill it holds, so the
/// driver's counter is sampled while allocations and frees of every process interleave.
const ROUNDS: u64 = 25;

/// A node with a 4 GiB device and 64 MiB contexts.
fn node(tag: &str) -> FakeNode {
    FakeNode::new(tag).with_env("FAKECUDA_DEVICE_BYTES", "4g").with_env("FAKECUDA_CONTEXT_BYTES", "64m")
}

/// A workload of `node` under the hook with the 1 GiB quota. (The fake driver binds its
/// references to its own entry points inside itself, as real libcuda does, so the addresses
/// its `cuGetProcAddress_v2` hands out are its own: only the hook's substitution covers them.)
fn hooked(node: &FakeNode, ledger: &Path) -> Result<Workload> {
    node.hooked(ledger, LIMIT)
}

/// Bytes the ledger charges on device 0.
fn ledger_used(path: &Path) -> Result<u64> {
    let ledger = Ledger::open(path).with_context(|| format!("opening {}", path.display()))?;
    let usage = ledger.device_usage()?;
    let chunk = ledger.header().devices[0].chunk;
    Ok(usage.first().context("the ledger has no device")?.used_chunks * chunk)
}

/// Bytes each live slot holds on device 0, by pid: (data + small, context, all kinds).
fn slots_by_pid(path: &Path) -> Result<BTreeMap<u32, (u64, u64, u64)>> {
    let ledger = Ledger::open(path)?;
    Ok(ledger
        .slots()?
        .into_iter()
        .map(|view| {
            let bytes = view.slot.devices[0].bytes;
            let data = bytes[Kind::Data as usize] + bytes[Kind::Small as usize];
            (view.slot.pid, (data, bytes[Kind::Context as usize], bytes.iter().sum()))
        })
        .collect())
}

/// After every process exited: no live slot, nothing charged, every invariant holds.
fn assert_ledger_empty(path: &Path) -> Result<()> {
    let ledger = Ledger::open(path)?;
    let slots = ledger.slots()?;
    ensure!(slots.is_empty(), "live slots left in the ledger: {slots:?}");
    for (device, usage) in ledger.device_usage()?.iter().enumerate() {
        ensure!(usage.used_chunks == 0, "device {device} still charged {} chunks", usage.used_chunks);
    }
    let problems = ledger.check()?;
    ensure!(problems.is_empty(), "ledger check: {problems:?}");
    Ok(())
}

/// (free, total) of the next `meminfo` line.
fn next_meminfo(w: &mut Running) -> Result<(u64, u64)> {
    let line = w.expect_prefix("meminfo ")?;
    Ok((field(&line, "free")?, field(&line, "total")?))
}

/// The hook's report must be the quota and the quota less the ledger's usage.
fn assert_meminfo(seen: (u64, u64), ledger: &Path, when: &str) -> Result<()> {
    let used = ledger_used(ledger)?;
    assert_eq!(seen, (LIMIT - used, LIMIT), "{when}: meminfo (free, total) with {used} bytes in the ledger");
    Ok(())
}

/// Polls the fake driver's own counter until stopped: (highest seen, samples taken).
fn monitor(node: &FakeNode, stop: &AtomicBool) -> Result<(u64, u64)> {
    let (mut highest, mut samples) = (0, 0);
    while !stop.load(Ordering::Relaxed) {
        highest = highest.max(node.used(0)?);
        samples += 1;
    }
    Ok((highest, samples))
}

/// Sets the flag when dropped, so a failing assertion (a panic) still stops the monitor.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// What one run of the concurrent fill saw.
#[derive(Debug, PartialEq, Eq)]
struct FillRun {
    allocations: u64,
    refusals: u64,
    /// (ledger, driver) bytes when every process held its fill, and after every free-fill.
    held: (u64, u64),
    freed: (u64, u64),
}

/// 8 processes x 4 threads fill a 1 GiB quota through `via`, hold, free, exit, while a
/// monitor watches the driver's counter; checks everything along the way.
fn concurrent_fill(via: Via) -> Result<FillRun> {
    let node = node("fill");
    let ledger = node.ledger_path();
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| -> Result<FillRun> {
        let watcher = scope.spawn(|| monitor(&node, &stop));
        let stopper = StopOnDrop(&stop);
        let result = (|| -> Result<FillRun> {
            let fill = format!("fill {THREADS} {FILL}");
            let mut steps = vec!["ctx 0".to_string(), "checkpoint ready".into()];
            for _ in 0..ROUNDS {
                steps.extend([fill.clone(), "free-fill".into()]);
            }
            steps.extend([
                fill,
                "checkpoint held".into(),
                // meminfo once every process is at the checkpoint, so nothing changes meanwhile
                "meminfo".into(),
                "checkpoint held-seen".into(),
                "free-fill".into(),
                "checkpoint freed".into(),
                "meminfo".into(),
                "checkpoint freed-seen".into(),
            ]);
            let mut workloads = (0..PROCESSES)
                .map(|_| hooked(&node, &ledger)?.via(via).steps(steps.clone()).spawn())
                .collect::<Result<Vec<_>>>()?;
            // Every context first, so the fills race for what the contexts leave.
            for w in &mut workloads {
                w.wait_checkpoint("ready")?;
            }
            assert_eq!(ledger_used(&ledger)?, PROCESSES * CTX, "{via:?}: the contexts are charged");
            for w in &mut workloads {
                w.resume()?;
            }
            let (mut allocations, mut refusals) = (0, 0);
            for w in &mut workloads {
                for _ in 0..ROUNDS {
                    let line = w.expect_prefix("fill ")?;
                    assert_eq!(field(&line, "refusals")?, THREADS, "{via:?}: {line}");
                }
                // The fill that holds.
                let line = w.expect_prefix("fill ")?;
                allocations += field(&line, "allocations")?;
                refusals += field(&line, "refusals")?;
                w.wait_checkpoint("held")?;
            }
            let held = (ledger_used(&ledger)?, node.used(0)?);
            every_meminfo_agrees(&mut workloads, &ledger, "held")?;
            let mut frees = 0;
            for w in &mut workloads {
                // A process may have lost every race and hold nothing: count them all.
                frees += field(&w.expect_prefix("free-fill ")?, "frees")?;
                w.wait_checkpoint("freed")?;
            }
            assert_eq!(frees, allocations, "{via:?}: every allocation freed");
            let freed = (ledger_used(&ledger)?, node.used(0)?);
            every_meminfo_agrees(&mut workloads, &ledger, "freed")?;
            for w in workloads {
                // Exit 0 means no refusal was anything but CUDA_ERROR_OUT_OF_MEMORY.
                let out = w.wait()?.success()?;
                let reports = out.stderr.matches("GPU memory quota exceeded").count();
                assert_eq!(reports, 1, "{via:?}: one rejection line per process: {:?}", out.stderr);
            }
            Ok(FillRun { allocations, refusals, held, freed })
        })();
        drop(stopper);
        let (highest, samples) = watcher.join().map_err(|_| anyhow::anyhow!("the monitor panicked"))??;
        let run = result?;
        eprintln!("{via:?}: the monitor sampled the driver {samples} times, highest {highest} bytes; {run:?}");
        assert!(highest <= LIMIT, "{via:?}: the driver handed out {highest} bytes, more than the {LIMIT} quota");
        assert!(samples >= 5, "{via:?}: the monitor took only {samples} samples");
        assert_eq!(node.used(0)?, 0, "{via:?}: everything back on the device");
        assert_ledger_empty(&ledger)?;
        Ok(run)
    })
}

/// Lets every workload past checkpoint `name` to print its meminfo and stop at `name-seen`,
/// then checks each against the ledger (unchanged meanwhile: they all wait), and lets them on.
fn every_meminfo_agrees(workloads: &mut [Running], ledger: &Path, name: &str) -> Result<()> {
    for w in workloads.iter_mut() {
        w.resume()?;
    }
    let mut seen = Vec::new();
    for w in workloads.iter_mut() {
        seen.push(next_meminfo(w)?);
        w.wait_checkpoint(&format!("{name}-seen"))?;
    }
    for s in seen {
        assert_meminfo(s, ledger, name)?;
    }
    for w in workloads.iter_mut() {
        w.resume()?;
    }
    Ok(())
}

/// What the concurrent fill must come to, whichever route reaches the driver.
fn expected_fill() -> FillRun {
    FillRun {
        allocations: (LIMIT - PROCESSES * CTX) / FILL,
        refusals: PROCESSES * THREADS,
        held: (LIMIT, LIMIT),
        freed: (PROCESSES * CTX, PROCESSES * CTX),
    }
}

#[test]
fn eight_processes_of_four_threads_never_exceed_the_quota() -> Result<()> {
    assert_eq!(concurrent_fill(Via::Dlsym)?, expected_fill());
    Ok(())
}

#[test]
fn get_proc_address_pointers_are_enforced_like_dlsym_ones() -> Result<()> {
    assert_eq!(concurrent_fill(Via::Getproc)?, expected_fill(), "the concurrent fill through cuGetProcAddress_v2");
    // One process, step by step: the same answers through either route.
    let steps = [
        "ctx 0",
        "meminfo",
        "alloc a 300m",
        "alloc s 1k",
        "pitch p 4000 1000 4", // pitch 4096 x 1000 rows: 2 chunks
        "meminfo",
        "expect-oom alloc big 700m",
        "fill 2 64m",
        "meminfo",
        "free-fill",
        "free a",
        "free s",
        "free p",
        "meminfo",
    ];
    let mut outputs = Vec::new();
    for via in [Via::Dlsym, Via::Getproc] {
        let node = node("route");
        let ledger = node.ledger_path();
        let out = hooked(&node, &ledger)?.via(via).steps(steps).run()?.success()?;
        assert_ledger_empty(&ledger)?;
        // Pointers aside (`ok STEP NAME 0xPTR BYTES`), every line must match.
        let lines: Vec<String> = out
            .stdout
            .iter()
            .filter(|l| !l.starts_with("ready ") && !l.starts_with("ctx "))
            .map(|l| l.split_whitespace().filter(|w| !w.starts_with("0x")).collect::<Vec<_>>().join(" "))
            .collect();
        outputs.push(lines);
    }
    assert_eq!(outputs[0], outputs[1], "dlsym and cuGetProcAddress_v2 runs differ");
    let fill = outputs[0].iter().find(|l| l.starts_with("fill ")).context("no fill line")?;
    // 1 GiB - 64 MiB context - 300 MiB - 2 MiB (small page) - 4 MiB (pitch 4096 x 1000 rows).
    assert_eq!(fill, &format!("fill allocations={} refusals=2", (LIMIT - CTX - 306 * MIB) / (64 * MIB)));
    assert!(outputs[0].iter().any(|l| l == "oom big"), "700m over the quota was refused: {:?}", outputs[0]);
    Ok(())
}

#[test]
fn without_the_hook_the_same_fill_overshoots() -> Result<()> {
    // The control: what the checks above would see if the hook were not enforcing.
    let node = node("control");
    let out = node.workload().steps(["ctx 0", &format!("fill {THREADS} {FILL}"), "devstat 0"]).run()?.success()?;
    let used = field(out.line("devstat ")?, "used")?;
    assert_eq!(used, 4 * GIB, "the unhooked fill takes the whole fake device");
    assert!(used > LIMIT);
    Ok(())
}

#[test]
fn meminfo_reports_the_quota_and_the_containers_usage_at_each_checkpoint() -> Result<()> {
    let node = node("meminfo");
    let ledger = node.ledger_path();
    let mut a = hooked(&node, &ledger)?
        .steps([
            "ctx 0",
            "meminfo",
            "checkpoint a1",
            "alloc a 300m",
            "alloc s 1k",
            "meminfo",
            "checkpoint a2",
            "free a",
            "meminfo",
            "checkpoint a3",
        ])
        .spawn()?;
    let seen = next_meminfo(&mut a)?;
    a.wait_checkpoint("a1")?;
    assert_meminfo(seen, &ledger, "A's context")?;
    assert_eq!(seen.0, LIMIT - CTX);
    a.resume()?;
    let seen = next_meminfo(&mut a)?;
    a.wait_checkpoint("a2")?;
    assert_meminfo(seen, &ledger, "A holds 300m + 1k")?;
    assert_eq!(seen.0, LIMIT - CTX - 302 * MIB, "1k takes a whole 2 MiB page");

    // A second process sees the container's usage, A's included.
    let mut b = hooked(&node, &ledger)?
        .steps(["ctx 0", "meminfo", "checkpoint b1", "alloc b 100m", "meminfo", "checkpoint b2", "meminfo", "checkpoint b3"])
        .spawn()?;
    let seen = next_meminfo(&mut b)?;
    b.wait_checkpoint("b1")?;
    assert_meminfo(seen, &ledger, "B's context")?;
    assert_eq!(seen.0, LIMIT - 2 * CTX - 302 * MIB);
    b.resume()?;
    let seen = next_meminfo(&mut b)?;
    b.wait_checkpoint("b2")?;
    assert_meminfo(seen, &ledger, "B holds 100m")?;
    a.resume()?;
    let seen = next_meminfo(&mut a)?;
    a.wait_checkpoint("a3")?;
    assert_meminfo(seen, &ledger, "A freed 300m")?;
    assert_eq!(seen.0, LIMIT - 2 * CTX - 102 * MIB);
    b.resume()?;
    let seen = next_meminfo(&mut b)?;
    b.wait_checkpoint("b3")?;
    assert_meminfo(seen, &ledger, "B after A's free")?;
    assert_eq!(node.used(0)?, ledger_used(&ledger)?, "the driver holds what the ledger charges");
    a.wait()?.success()?;
    b.wait()?.success()?;
    assert_ledger_empty(&ledger)?;
    Ok(())
}

#[test]
fn null_meminfo_pointers_get_the_drivers_answer() -> Result<()> {
    let steps = ["meminfo-null", "ctx 0", "meminfo-null", "alloc a 10m", "meminfo-null", "meminfo"];
    let node = node("null");
    let ledger = node.ledger_path();
    let with_hook = hooked(&node, &ledger)?.steps(steps).run()?.success()?;
    let bare = node.workload().steps(steps).run()?.success()?;
    let hooked_lines: Vec<&str> = with_hook.lines("meminfo-null ").collect();
    let bare_lines: Vec<&str> = bare.lines("meminfo-null ").collect();
    assert_eq!(hooked_lines.len(), 3, "{:?}", with_hook.stdout);
    assert_eq!(hooked_lines, bare_lines, "the hook returns the driver's codes");
    for line in hooked_lines {
        assert_ne!(field(line, "null-free")?, 0, "a NULL free pointer is an error: {line}");
        assert_ne!(field(line, "null-total")?, 0, "a NULL total pointer is an error: {line}");
    }
    assert_eq!(field(with_hook.line("meminfo ")?, "total")?, LIMIT, "the hook is enforcing in that process");
    Ok(())
}

#[test]
fn a_forked_child_gets_its_own_slot() -> Result<()> {
    let node = node("fork");
    let ledger = node.ledger_path();
    let mut w = hooked(&node, &ledger)?
        .steps([
            "ctx 0",
            "alloc a 300m",
            "fork ctx 0; alloc b 200m; meminfo; checkpoint child-held",
            "meminfo",
            "checkpoint parent-alone",
            "free a",
            "meminfo",
            "checkpoint parent-freed",
        ])
        .spawn()?;
    let parent = w.pid();
    let child = field(&w.expect_prefix("child ready ")?, "pid")? as u32;
    let line = w.expect_prefix("child meminfo ")?;
    w.expect_prefix("child checkpoint child-held")?;
    let slots = slots_by_pid(&ledger)?;
    assert_eq!(slots.len(), 2, "parent and child each have a slot: {slots:?}");
    assert_eq!(slots.get(&parent).map(|s| (s.0, s.1)), Some((300 * MIB, CTX)), "the parent's slot: {slots:?}");
    assert_eq!(slots.get(&child).map(|s| (s.0, s.1)), Some((200 * MIB, CTX)), "the child's slot: {slots:?}");
    let used = ledger_used(&ledger)?;
    assert_eq!(used, 2 * CTX + 500 * MIB);
    assert_eq!(field(&line, "free")?, LIMIT - used, "the child's meminfo counts the parent's memory");
    assert_eq!(node.used(0)?, used, "the driver holds what the ledger charges");
    w.resume()?; // the child reads it: the parent waits in waitpid

    let status = w.expect_prefix("fork ")?;
    assert_eq!(status, format!("fork child={child} exit=0"));
    let seen = next_meminfo(&mut w)?;
    w.wait_checkpoint("parent-alone")?;
    // The child's exit released its slot (nothing else ran to sweep it); the parent's
    // allocations stayed with the parent.
    let slots = slots_by_pid(&ledger)?;
    assert_eq!(slots.keys().copied().collect::<Vec<_>>(), vec![parent], "{slots:?}");
    assert_eq!(slots[&parent].2, CTX + 300 * MIB);
    assert_meminfo(seen, &ledger, "after the child's exit")?;
    assert_eq!(seen.0, LIMIT - CTX - 300 * MIB);
    w.resume()?;
    let seen = next_meminfo(&mut w)?;
    w.wait_checkpoint("parent-freed")?;
    assert_meminfo(seen, &ledger, "the parent freed a")?;
    assert_eq!(seen.0, LIMIT - CTX, "the parent's free of its own allocation is released");
    w.wait()?.success()?;
    assert_ledger_empty(&ledger)?;
    assert_eq!(node.used(0)?, 0);
    Ok(())
}

#[test]
fn a_forked_child_cannot_take_what_the_parent_holds() -> Result<()> {
    let node = node("fork-full");
    let ledger = node.ledger_path();
    // The parent fills the quota; the child's context no longer fits.
    let out = hooked(&node, &ledger)?
        .steps(["ctx 0", "fill 2 16m", "fork expect-oom ctx 0", "free-fill", "fork ctx 0; alloc b 500m"])
        .run()?
        .success()?;
    let forks: Vec<&str> = out.lines("fork ").collect();
    assert_eq!(forks.len(), 2, "{:?}", out.stdout);
    assert!(forks.iter().all(|l| l.ends_with(" exit=0")), "both children ran their steps: {forks:?} {}", out.stderr);
    assert!(out.line("child oom ctx").is_ok(), "the full quota refused the child's context: {:?}", out.stdout);
    assert_ledger_empty(&ledger)?;
    Ok(())
}

#[test]
fn threads_of_one_process_share_its_quota_exactly() -> Result<()> {
    let node = node("threads");
    let ledger = node.ledger_path();
    let mut w = hooked(&node, &ledger)?.steps(["ctx 0", "fill 8 2m", "checkpoint held", "free-fill"]).spawn()?;
    let line = w.expect_prefix("fill ")?;
    w.wait_checkpoint("held")?;
    assert_eq!(line, format!("fill allocations={} refusals=8", (LIMIT - CTX) / (2 * MIB)));
    let slots = slots_by_pid(&ledger)?;
    assert_eq!(slots.get(&w.pid()).map(|s| (s.0, s.1)), Some((LIMIT - CTX, CTX)), "{slots:?}");
    assert_eq!(node.used(0)?, LIMIT, "the driver holds exactly the quota");
    let out = w.wait()?.success()?;
    assert_eq!(out.line("free-fill ")?, format!("free-fill frees={}", (LIMIT - CTX) / (2 * MIB)));
    assert_ledger_empty(&ledger)?;
    Ok(())
}

/// Stream-ordered pools (PyTorch's `backend:cudaMallocAsync`): memory a pool keeps reserved
/// after frees stays charged until the pool is trimmed, so the device never holds more than
/// the quota; a pool reuses what it holds without a new charge.
#[test]
fn a_pool_is_charged_for_what_it_holds_until_trimmed() -> Result<()> {
    for (alloc, free) in [("async", "free-async"), ("pool", "free-async"), ("async-ptsz", "free-async-ptsz")] {
        let node = node("pools");
        let ledger = node.ledger_path();
        let mut w = hooked(&node, &ledger)?
            .steps([
                "ctx 0".to_string(),
                format!("{alloc} a 600m"),
                format!("{free} a"),
                "checkpoint freed".to_string(),
                "expect-oom alloc b 600m".to_string(),
                format!("{alloc} c 500m"),
                "checkpoint reused".to_string(),
                format!("{free} c"),
                "trim 0".to_string(),
                "checkpoint trimmed".to_string(),
                "alloc b 600m".to_string(),
                "checkpoint moved".to_string(),
                "free b".to_string(),
            ])
            .spawn()?;
        w.wait_checkpoint("freed")?;
        // Freed, but still reserved by the pool: charged, and held by the driver.
        assert_eq!(ledger_used(&ledger)?, CTX + 600 * MIB, "{alloc}: the freed pool memory stays charged");
        assert_eq!(node.used(0)?, CTX + 600 * MIB, "{alloc}: the driver still holds it");
        w.resume()?;
        w.wait_checkpoint("reused")?;
        assert_eq!(ledger_used(&ledger)?, CTX + 600 * MIB, "{alloc}: reusing the pool's memory costs nothing more");
        w.resume()?;
        w.wait_checkpoint("trimmed")?;
        assert_eq!(ledger_used(&ledger)?, CTX, "{alloc}: trimming gives the quota back");
        w.resume()?;
        w.wait_checkpoint("moved")?;
        assert!(node.used(0)? <= LIMIT, "{alloc}: the driver never holds more than the quota");
        w.resume()?;
        let out = w.wait()?.success()?;
        assert_eq!(out.lines("oom ").collect::<Vec<_>>(), ["oom b"], "{alloc}: only the over-quota allocation refused");
        assert_ledger_empty(&ledger)?;
    }
    Ok(())
}

/// A quota on one device leaves the other limited only by what it has.
#[test]
fn a_quota_on_one_device_leaves_the_other_unlimited() -> Result<()> {
    let node = node("partial").with_env("FAKECUDA_DEVICE_COUNT", "2");
    let ledger = node.ledger_path();
    let out = hooked(&node, &ledger)?
        .env("CUDA_DEVICE_MEMORY_LIMIT", "")
        .env("CUDA_DEVICE_MEMORY_LIMIT_1", "1g")
        .steps(["ctx 0", "alloc a 3g", "meminfo", "ctx 1", "meminfo", "expect-oom alloc b 2g", "alloc c 512m"])
        .run()?
        .success()?;
    let meminfo: Vec<&str> = out.lines("meminfo ").collect();
    assert_eq!(field(meminfo[0], "total")?, 4 * GIB, "device 0 shows all it has: {meminfo:?}");
    assert_eq!(field(meminfo[1], "total")?, GIB, "device 1 shows its quota: {meminfo:?}");
    assert_eq!(out.lines("oom ").collect::<Vec<_>>(), ["oom b"]);
    Ok(())
}

/// The bytes of the workload's next `ok alloc NAME 0xPTR BYTES` line.
fn allocated(w: &mut Running, name: &str) -> Result<u64> {
    let line = w.expect_prefix(&format!("ok alloc {name} "))?;
    let bytes = line.split_whitespace().nth(4).and_then(parse_u64);
    bytes.with_context(|| format!("bad line {line:?}"))
}

/// Bounds latency: the next process waits under 500 ms.
#[test]
fn a_sigkilled_holders_quota_goes_to_the_next_process_at_once() -> Result<()> {
    let node = node("sigkill");
    let ledger = node.ledger_path();
    let holder = |steps: &[&str]| -> Result<Workload> { Ok(hooked(&node, &ledger)?.steps(steps.iter().copied())) };
    let mut a = holder(&["ctx 0", "alloc a 800m", "checkpoint held", "hold"])?.spawn()?;
    a.wait_checkpoint("held")?;
    // B is already running (its slot registered) when A dies.
    let mut b = holder(&["ctx 0", "checkpoint go", "alloc b 800m", "checkpoint held", "hold"])?.spawn()?;
    b.wait_checkpoint("go")?;
    let a_pid = a.pid();
    let killed = a.kill()?;
    assert_eq!(killed.status.code(), None, "A died of SIGKILL");
    assert!(slots_by_pid(&ledger)?.contains_key(&a_pid), "nothing has swept A's slot yet");
    let start = Instant::now();
    b.resume()?;
    assert_eq!(allocated(&mut b, "b")?, 800 * MIB);
    let elapsed = start.elapsed();
    b.wait_checkpoint("held")?;
    eprintln!("B's 800m after A's SIGKILL: {elapsed:?}");
    assert!(elapsed < Duration::from_millis(500), "B waited {elapsed:?} for a dead holder's quota");
    assert!(!b.stderr().contains("quota exceeded"), "B was never refused: {}", b.stderr());
    let slots = slots_by_pid(&ledger)?;
    assert_eq!(slots.keys().copied().collect::<Vec<_>>(), vec![b.pid()], "A's slot was swept: {slots:?}");
    assert_eq!(ledger_used(&ledger)?, CTX + 800 * MIB);

    // A process that starts after a holder died proceeds at once too.
    let b_pid = b.pid();
    b.kill()?;
    let start = Instant::now();
    let out = holder(&["ctx 0", "alloc c 900m"])?.run()?.success()?;
    let elapsed = start.elapsed();
    assert!(out.line("ok alloc c ").is_ok());
    eprintln!("C, started after B's SIGKILL, ran to its end in {elapsed:?}");
    assert!(elapsed < Duration::from_secs(2), "C took {elapsed:?}");
    assert!(!out.stderr.contains("quota exceeded"), "C was never refused: {}", out.stderr);
    ensure!(!slots_by_pid(&ledger)?.contains_key(&b_pid), "B's slot was swept");
    assert_ledger_empty(&ledger)?;
    assert_eq!(node.used(0)?, 0);
    Ok(())
}

/// The state letter of `/proc/<pid>/stat` (after the command name).
fn process_state(pid: u32) -> Result<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let after = stat.rfind(')').map(|i| &stat[i + 1..]).context("unreadable stat")?;
    after.trim_start().chars().next().context("no state in stat")
}

#[test]
fn a_sigkilled_holder_that_is_not_reaped_yet_holds_nothing() -> Result<()> {
    // A killed process's GPU memory is gone when it exits, before its parent reaps it (the
    // fake driver reaps zombies' memory too); a parent that is slow to reap, or a container
    // whose init never does, must not keep the quota taken.
    let node = node("zombie");
    let ledger = node.ledger_path();
    let mut a = hooked(&node, &ledger)?.steps(["ctx 0", "alloc a 800m", "checkpoint held", "hold"]).spawn()?;
    a.wait_checkpoint("held")?;
    a.signal(libc::SIGKILL)?;
    let deadline = Instant::now() + Duration::from_secs(5);
    while process_state(a.pid())? != 'Z' {
        ensure!(Instant::now() < deadline, "A did not die");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(node.used(0)?, 0, "the driver holds nothing for a zombie");
    let out = hooked(&node, &ledger)?.steps(["ctx 0", "alloc b 800m"]).run()?;
    a.wait()?;
    let out = out.success()?;
    assert!(out.line("ok alloc b ").is_ok());
    assert_ledger_empty(&ledger)?;
    Ok(())
}

/// Ways to break a ledger file; each returns what the hook's message must mention.
fn corrupt(kind: &str, ledger: &Path, node: &FakeNode) -> Result<&'static str> {
    match kind {
        "garbage" => {
            let text: Vec<u8> = b"this is not a ledger\n".iter().copied().cycle().take(64 << 10).collect();
            std::fs::write(ledger, text)?;
            Ok("not a vramguard ledger")
        }
        "empty" => {
            std::fs::write(ledger, b"")?;
            Ok("truncated")
        }
        "raised-limit" => {
            // A valid ledger whose limit a workload raised to 1 TiB: the checksum says no.
            hooked(node, ledger)?.steps(["ctx 0", "alloc a 2m"]).run()?.success()?;
            let offset = std::mem::offset_of!(Header, devices) + std::mem::offset_of!(DeviceConfig, limit);
            let mut bytes = std::fs::read(ledger)?;
            bytes[offset..offset + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
            std::fs::write(ledger, bytes)?;
            Ok("checksum")
        }
        other => bail!("unknown corruption {other}"),
    }
}

#[test]
fn a_corrupt_ledger_refuses_gpu_memory_or_with_fail_open_runs_unlimited() -> Result<()> {
    for kind in ["garbage", "empty", "raised-limit"] {
        let node = node("corrupt");
        let ledger = node.ledger_path();
        let why = corrupt(kind, &ledger, &node)?;
        let before = std::fs::read(&ledger)?;

        // Default policy: refuse GPU memory, contexts included (each is real device memory),
        // with one message naming the ledger and what is wrong.
        let out = hooked(&node, &ledger)?
            .steps(["expect-oom ctx 0", "expect-oom alloc a 2m", "expect-oom alloc s 1k", "expect-oom managed m 2m", "devstat 0"])
            .run()?
            .success()?;
        let refused: Vec<&str> = out.lines("oom ").collect();
        assert_eq!(refused.len(), 4, "{kind}: the context and three allocations refused: {:?}", out.stdout);
        assert_eq!(field(out.line("devstat ")?, "used")?, 0, "{kind}: nothing reached the driver");
        let message = format!("cannot use the ledger {}", ledger.display());
        assert_eq!(out.stderr.matches(&message).count(), 1, "{kind}: one message: {:?}", out.stderr);
        assert!(out.stderr.contains(why), "{kind}: the message says what is wrong ({why}): {:?}", out.stderr);
        assert!(out.stderr.contains("VRAMGUARD_FAIL_OPEN=1"), "{kind}: the message names the opt-out: {:?}", out.stderr);

        // Opt-out: run without limits, saying so.
        let out = hooked(&node, &ledger)?
            .env("VRAMGUARD_FAIL_OPEN", "1")
            .steps(["ctx 0", "alloc a 2g", "meminfo"])
            .run()?
            .success()?;
        assert!(out.line("ok alloc a ").is_ok(), "{kind}: 2 GiB over a 1 GiB quota runs unlimited");
        assert_eq!(field(out.line("meminfo ")?, "total")?, 4 * GIB, "{kind}: the driver's own meminfo");
        assert!(out.stderr.contains(&message), "{kind}: {:?}", out.stderr);
        assert!(out.stderr.contains("WITHOUT GPU memory limits"), "{kind}: a warning: {:?}", out.stderr);
        assert_eq!(std::fs::read(&ledger)?, before, "{kind}: the hook never writes a ledger it cannot trust");
    }
    Ok(())
}


/// NVML's two memory answers in an `nvml-meminfo` line: ((total, free, used), v2's, v2's reserved).
type NvmlSeen = ((u64, u64, u64), (u64, u64, u64), u64);

/// The next `nvml-meminfo` line.
fn next_nvml(w: &mut Running) -> Result<NvmlSeen> {
    let line = w.expect_prefix("nvml-meminfo ")?;
    Ok((
        (field(&line, "total")?, field(&line, "free")?, field(&line, "used")?),
        (field(&line, "v2-total")?, field(&line, "v2-free")?, field(&line, "v2-used")?),
        field(&line, "v2-reserved")?,
    ))
}

/// At a checkpoint: `cuMemGetInfo_v2`'s (free, total) and NVML's numbers (looked up on NVML's
/// handle, and in the global scope) must all be the quota and the quota less the ledger's usage.
fn assert_nvml_agrees(w: &mut Running, ledger: &Path, when: &str) -> Result<()> {
    let meminfo = next_meminfo(w)?;
    let by_handle = next_nvml(w)?;
    let global = next_nvml(w)?;
    w.wait_checkpoint(when)?;
    assert_meminfo(meminfo, ledger, when)?;
    let used = ledger_used(ledger)?;
    let expected = (LIMIT, LIMIT - used, used);
    assert_eq!(by_handle, (expected, expected, 0), "{when}: NVML through dlsym on its handle, {used} bytes in the ledger");
    assert_eq!(global, (expected, expected, 0), "{when}: NVML through the global scope (the hook's export)");
    assert_eq!((meminfo.1, meminfo.0), (by_handle.0 .0, by_handle.0 .1), "{when}: cuMemGetInfo_v2 and NVML agree");
    Ok(())
}

/// The steps that print what a checkpoint compares.
fn report(checkpoint: &str) -> [String; 4] {
    ["meminfo".into(), "nvml-meminfo 0".into(), "nvml-meminfo 0 global".into(), format!("checkpoint {checkpoint}")]
}

#[test]
fn nvml_reports_what_cu_mem_get_info_reports_at_each_checkpoint() -> Result<()> {
    let node = node("nvml");
    let ledger = node.ledger_path();
    let mut a_steps = vec!["ctx 0".to_string()];
    a_steps.extend(report("a1"));
    a_steps.extend(["alloc a 300m".into(), "alloc s 1k".into()]);
    a_steps.extend(report("a2"));
    a_steps.push("free a".into());
    a_steps.extend(report("a3"));
    let mut a = hooked(&node, &ledger)?.steps(a_steps).spawn()?;
    assert_nvml_agrees(&mut a, &ledger, "a1")?;
    a.resume()?;
    assert_nvml_agrees(&mut a, &ledger, "a2")?;
    assert_eq!(ledger_used(&ledger)?, CTX + 302 * MIB);

    // A second process sees the container's usage through NVML too, A's included.
    let mut b_steps = vec!["ctx 0".to_string(), "alloc b 100m".into()];
    b_steps.extend(report("b1"));
    let mut b = hooked(&node, &ledger)?.steps(b_steps).spawn()?;
    assert_nvml_agrees(&mut b, &ledger, "b1")?;
    assert_eq!(ledger_used(&ledger)?, 2 * CTX + 402 * MIB);
    a.resume()?;
    assert_nvml_agrees(&mut a, &ledger, "a3")?;
    assert_eq!(ledger_used(&ledger)?, 2 * CTX + 102 * MIB);
    a.wait()?.success()?;
    b.wait()?.success()?;
    assert_ledger_empty(&ledger)?;
    Ok(())
}

#[test]
fn without_the_hook_nvml_shows_the_devices_true_numbers() -> Result<()> {
    // The control: the same report with no hook is the whole fake device, every process's
    // memory counted.
    let node = node("nvml-control");
    let mut holder = node.workload().steps(["ctx 0", "alloc h 500m", "checkpoint held"]).spawn()?;
    holder.wait_checkpoint("held")?;
    let mut steps = vec!["ctx 0".to_string(), "alloc a 300m".into()];
    steps.extend(report("seen"));
    let mut w = node.workload().steps(steps).spawn()?;
    let meminfo = next_meminfo(&mut w)?;
    let by_handle = next_nvml(&mut w)?;
    let global = next_nvml(&mut w)?;
    w.wait_checkpoint("seen")?;
    let (used, total) = node.devstat(0)?;
    assert_eq!((used, total), (2 * CTX + 800 * MIB, 4 * GIB));
    let expected = (total, total - used, used);
    assert_eq!(by_handle, (expected, expected, 0), "NVML shows the device");
    assert_eq!(global, by_handle);
    assert_eq!(meminfo, (total - used, total), "and so does cuMemGetInfo_v2");
    w.wait()?.success()?;
    holder.wait()?.success()?;
    Ok(())
}

#[test]
fn null_nvml_pointers_get_the_drivers_answer() -> Result<()> {
    let steps = ["nvml-null 0", "ctx 0", "alloc a 10m", "nvml-null 0", "nvml-meminfo 0"];
    let node = node("nvml-null");
    let ledger = node.ledger_path();
    let with_hook = hooked(&node, &ledger)?.steps(steps).run()?.success()?;
    let bare = node.workload().steps(steps).run()?.success()?;
    let hooked_lines: Vec<&str> = with_hook.lines("nvml-null ").collect();
    let bare_lines: Vec<&str> = bare.lines("nvml-null ").collect();
    assert_eq!(hooked_lines.len(), 2, "{:?}", with_hook.stdout);
    assert_eq!(hooked_lines, bare_lines, "the hook returns NVML's codes");
    // NVML_ERROR_INVALID_ARGUMENT for NULL, NVML_ERROR_ARGUMENT_VERSION_MISMATCH for version 0.
    assert!(hooked_lines.iter().all(|l| *l == "nvml-null v1=2 v2=2 v2-version=25"), "{hooked_lines:?}");
    assert_eq!(field(with_hook.line("nvml-meminfo ")?, "total")?, LIMIT, "the hook is enforcing in that process");
    assert_eq!(field(bare.line("nvml-meminfo ")?, "total")?, 4 * GIB);
    Ok(())
}

#[test]
fn nvml_without_cu_init_shows_the_containers_ledger_once_there_is_one() -> Result<()> {
    let node = node("nvml-noinit");
    let ledger = node.ledger_path();
    let nvml_only = |node: &FakeNode| -> Result<Workload> {
        Ok(hooked(node, &ledger)?.arg("--no-init").steps(["nvml-meminfo 0", "nvml-meminfo 0 global"]))
    };
    // No ledger yet: nothing is charged to the container, and NVML's numbers are the device's.
    let out = nvml_only(&node)?.run()?.success()?;
    assert!(!ledger.exists(), "a process without cuInit creates no ledger");
    for line in out.lines("nvml-meminfo ") {
        assert_eq!((field(line, "total")?, field(line, "used")?), (4 * GIB, 0), "{line}");
    }
    // Once a process of the container made the ledger, the quota and its usage.
    let mut a = hooked(&node, &ledger)?.steps(["ctx 0", "alloc a 300m", "checkpoint held"]).spawn()?;
    a.wait_checkpoint("held")?;
    let out = nvml_only(&node)?.run()?.success()?;
    let used = ledger_used(&ledger)?;
    assert_eq!(used, CTX + 300 * MIB);
    let lines: Vec<&str> = out.lines("nvml-meminfo ").collect();
    assert_eq!(lines.len(), 2, "{:?}", out.stdout);
    for line in lines {
        assert_eq!(
            (field(line, "total")?, field(line, "free")?, field(line, "used")?, field(line, "v2-free")?),
            (LIMIT, LIMIT - used, used, LIMIT - used),
            "{line}"
        );
    }
    a.wait()?.success()?;
    assert_ledger_empty(&ledger)?;
    Ok(())
}

#[test]
fn nvml_finds_the_enforced_device_by_its_uuid() -> Result<()> {
    // Two devices with different quotas: NVML's handle of each shows its own quota and usage.
    let node = node("nvml-uuid").with_env("FAKECUDA_DEVICE_COUNT", "2");
    let ledger = node.ledger_path();
    let out = node
        .workload()
        .env("LD_PRELOAD", e2e::hook_lib()?)
        .env("CUDA_DEVICE_MEMORY_LIMIT_0", (2 * LIMIT).to_string())
        .env("CUDA_DEVICE_MEMORY_LIMIT_1", LIMIT.to_string())
        .env("VRAMGUARD_LEDGER", &ledger)
        .env("VRAMGUARD_CONTEXT_RESERVE", CTX.to_string())
        .steps(["ctx 1", "alloc a 100m", "nvml-meminfo 1", "nvml-meminfo 0", "nvml-uuid 0", "nvml-uuid 1"])
        .run()?
        .success()?;
    let lines: Vec<&str> = out.lines("nvml-meminfo ").collect();
    assert_eq!(lines.len(), 2, "{:?}", out.stdout);
    let used = CTX + 100 * MIB;
    assert_eq!((field(lines[0], "total")?, field(lines[0], "used")?), (LIMIT, used), "device 1: {}", lines[0]);
    assert_eq!((field(lines[1], "total")?, field(lines[1], "used")?), (2 * LIMIT, 0), "device 0: {}", lines[1]);
    let uuids: Vec<&str> = out.lines("nvml-uuid ").collect();
    assert_eq!(uuids.len(), 2, "{:?}", out.stdout);
    for line in &uuids {
        let w: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(w.get(1).and_then(|n| n.strip_prefix("nvml=")), w.get(2).and_then(|c| c.strip_prefix("cuda=")), "{line}");
    }
    assert_ne!(uuids[0], uuids[1], "two devices, two UUIDs");
    Ok(())
}
