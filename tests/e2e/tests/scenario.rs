//! The agent's must-show scenario (issue "The agent"), as one test: one `vramguard run` with
//! `--ledger-dir`, `--metrics-addr`, `--limits` and `--enforce signal` on one fake GPU, and
//! three containers, each a cgroup of its own:
//!
//! * A, hooked and within its quota, two processes, its names given by the downward API
//!   variables (`POD_NAMESPACE`, `POD_NAME`, `CONTAINER_NAME`), in a cgroup shaped like the
//!   systemd driver's (`…/kubepods-burstable-pod<uid>.slice/cri-containerd-<id>.scope`);
//! * B, hooked and pushed over its quota (one allocation refused), in a cgroup shaped like
//!   the cgroupfs driver's (`…/kubepods/burstable/pod<uid>/<id>`);
//! * C, not hooked, with a 1 GiB limit in the limits file.
//!
//! `/metrics` is scraped and parsed: A's and B's used bytes equal their ledgers and the eBPF
//! view, with A's names and both pod UIDs as labels (and under HAMi's names for A); B's
//! rejection is counted; C is `unhooked`, then killed by SIGKILL before the allocation that
//! would pass its limit (its `ok alloc c2` line never appears, and the fake driver never
//! counts it). One of A's processes is SIGKILLed: its slot is reclaimed within 1 s (the
//! latency is printed). A process whose own slot is written to zero is reported `tampered`.
//! Needs root; build first with `cargo xtask test` (or `cargo build -p agent -p hook -p
//! fakecuda -p workload`), and run one test at a time.
use std::{ffi::OsStr, os::unix::process::ExitStatusExt, path::Path, time::Duration};

use anyhow::{ensure, Context, Result};
use e2e::{
    agent::Agent,
    cgroup::TestCgroup,
    holding,
    http::{fresh_scrape, metric, samples, scrape, Sample},
    ledgers, wait_for, FakeNode, TempDir, GIB, MIB,
};
use ledger::{Kind, Ledger};

const QUOTA: u64 = GIB;
const CTX: u64 = 64 * MIB;
const UID_A: &str = "3f1b9c2e-7d4a-4e8b-9a61-0c5d2e8f7a13";
const UID_B: &str = "9e0d7c6b-5a49-4382-b1f0-e2d3c4b5a697";
const ID_A: &str = "a1a2a3a4a5a6a7a8a9aaabacadaeafb0b1b2b3b4b5b6b7b8b9babbbcbdbebfc0";
const ID_B: &str = "b0b1b2b3b4b5b6b7b8b9babbbcbdbebfc0c1c2c3c4c5c6c7c8c9cacbcccdcecf";
const NAMES_A: [(&str, &str); 3] = [("POD_NAMESPACE", "team-a"), ("POD_NAME", "trainer-0"), ("CONTAINER_NAME", "main")];

/// The samples of family `name` for the ledger at `path`.
fn of_ledger<'a>(all: &'a [Sample], name: &'a str, path: &Path) -> Vec<&'a Sample> {
    let path = path.display().to_string();
    samples(all, name).filter(|s| s.label("ledger") == path).collect()
}

/// `vramguard_process_state{pid,state}`.
fn state(all: &[Sample], pid: u32, state: &str) -> Option<f64> {
    metric(all, "vramguard_process_state", &[("pid", &pid.to_string()), ("state", state)])
}

/// Requested bytes the ledger charges for its live slots' data, small and managed
/// allocations on device 0 (what the eBPF view is compared with).
fn ledger_requested(path: &Path) -> Result<u64> {
    let requested = Ledger::open(path)?
        .slots()?
        .iter()
        .flat_map(|view| [Kind::Data, Kind::Small, Kind::Managed].map(|kind| view.slot.devices[0].bytes[kind as usize]))
        .sum();
    Ok(requested)
}

/// Checks what the scrape says of the ledger at `path` against the ledger itself, the eBPF
/// view and the expected container labels; returns the used bytes.
fn check_container(all: &[Sample], path: &Path, labels: &[(&str, &str)], ebpf_bytes: u64) -> Result<u64> {
    let used = of_ledger(all, "vramguard_container_memory_used_bytes", path);
    ensure!(used.len() == 4, "one used series per kind for {}: {used:?}", path.display());
    let total: u64 = used.iter().map(|s| s.value as u64).sum();
    ensure!(total == ledgers::used(path)?, "{}: used {total} vs the ledger's {}", path.display(), ledgers::used(path)?);
    let data = used.iter().find(|s| s.label("kind") == "data").map(|s| s.value as u64);
    let ebpf = of_ledger(all, "vramguard_container_ebpf_memory_bytes", path).first().map(|s| s.value as u64);
    ensure!(data == Some(ebpf_bytes) && ebpf == Some(ebpf_bytes), "{}: data {data:?}, eBPF {ebpf:?}, want {ebpf_bytes}", path.display());
    ensure!(ledger_requested(path)? == ebpf_bytes, "{}: the ledger's requested bytes equal the eBPF view", path.display());
    for family in [
        "vramguard_container_memory_used_bytes",
        "vramguard_container_memory_limit_bytes",
        "vramguard_container_rejections_total",
        "vramguard_container_ebpf_memory_bytes",
    ] {
        let series = of_ledger(all, family, path);
        ensure!(!series.is_empty(), "no {family} for {}", path.display());
        for sample in series {
            for (key, value) in labels {
                ensure!(sample.label(key) == *value, "{family} of {}: {key}={:?}, want {value:?}", path.display(), sample.label(key));
            }
        }
    }
    Ok(total)
}

#[test]
fn three_containers_metrics_enforcement_reclaim_and_tampering() -> Result<()> {
    let node = FakeNode::new("scenario").with_env("FAKECUDA_DEVICE_BYTES", "4g").with_env("FAKECUDA_CONTEXT_BYTES", "64m");
    let dir = TempDir::new("scenario")?;
    let (ledger_a, ledger_b) = (dir.ledger("pod-a")?, dir.ledger("pod-b")?);
    let systemd_uid = UID_A.replace('-', "_");
    let cgroup_a = TestCgroup::create_nested(
        "scenario-a",
        &format!("kubepods-burstable.slice/kubepods-burstable-pod{systemd_uid}.slice/cri-containerd-{ID_A}.scope"),
    )?;
    let cgroup_b = TestCgroup::create_nested("scenario-b", &format!("kubepods/burstable/pod{UID_B}/{ID_B}"))?;
    let cgroup_c = TestCgroup::create("scenario-c")?;
    // Outside the ledger directory (every file there is taken for a ledger).
    let config = TempDir::new("scenario-limits")?;
    let limits = config.path().join("limits");
    std::fs::write(&limits, format!("# C may hold 1 GiB\n{} 1g\n", cgroup_c.path))?;
    let agent = Agent::watching(dir.path(), &[
        OsStr::new("--limits"),
        limits.as_os_str(),
        OsStr::new("--enforce"),
        OsStr::new("signal"),
        // A, B and C each run in a cgroup of their own.
        OsStr::new(e2e::cgroup::SEPARATES_CONTAINERS),
        OsStr::new("--hami-metrics"),
    ])?;
    let addr = agent.metrics_addr()?;

    let named = |workload: e2e::Workload| NAMES_A.iter().fold(workload, |w, &(k, v)| w.env(k, v));
    let a1 = holding(named(node.hooked(&ledger_a, QUOTA)?).in_cgroup(&cgroup_a), &["ctx 0", "alloc a1 100m"])?;
    let a2 = holding(named(node.hooked(&ledger_a, QUOTA)?).in_cgroup(&cgroup_a), &["ctx 0", "alloc a2 200m"])?;
    let b = holding(node.hooked(&ledger_b, QUOTA)?.in_cgroup(&cgroup_b), &["ctx 0", "alloc b1 600m", "expect-oom alloc b2 600m"])?;
    let mut c = node
        .workload()
        .in_cgroup(&cgroup_c)
        .steps(["ctx 0", "alloc c1 600m", "checkpoint one", "alloc c2 600m", "checkpoint two"])
        .spawn()?;
    c.wait_checkpoint("one")?;
    assert_eq!(node.used(0)?, 4 * CTX + 1500 * MIB, "A, B and C's first allocation on the device");

    // Everything reconciled, and the pod UIDs found from the slots' host processes (their
    // host pids are recorded within a second).
    let a_labels = [("namespace", "team-a"), ("pod", "trainer-0"), ("container", "main"), ("pod_uid", UID_A)];
    let b_labels = [("namespace", ""), ("pod", ""), ("container", ""), ("pod_uid", UID_B)];
    let mut last = Vec::new();
    let ready = wait_for(Duration::from_secs(5), "every container reconciled and labelled", || {
        let all = scrape(addr)?;
        last = all.clone();
        let labelled = |path: &Path, labels: &[(&str, &str)]| {
            let series = of_ledger(&all, "vramguard_container_memory_limit_bytes", path);
            !series.is_empty() && series.iter().all(|s| labels.iter().all(|(k, v)| s.label(k) == *v))
        };
        Ok([a1.pid(), a2.pid(), b.pid()].iter().all(|&pid| state(&all, pid, "ok") == Some(1.0))
            && state(&all, c.pid(), "unhooked") == Some(1.0)
            && labelled(&ledger_a, &a_labels)
            && labelled(&ledger_b, &b_labels))
    })
    .with_context(|| {
        let shown = ["vramguard_process_state", "vramguard_container_memory_limit_bytes"];
        let lines: Vec<String> =
            last.iter().filter(|s| shown.contains(&s.name.as_str()) && s.value != 0.0).map(|s| format!("{s:?}")).collect();
        format!("the last scrape: {lines:#?}\nthe agent's log: {}", agent.log())
    })?;
    eprintln!("all three containers reconciled and labelled after {ready:?}");

    let all = scrape(addr)?;
    let used_a = check_container(&all, &ledger_a, &a_labels, 300 * MIB)?;
    assert_eq!(used_a, 2 * CTX + 300 * MIB, "A's two processes with their context reserves");
    let used_b = check_container(&all, &ledger_b, &b_labels, 600 * MIB)?;
    assert_eq!(used_b, CTX + 600 * MIB, "B holds b1 only");
    for (pid, bytes) in [(a1.pid(), 100 * MIB), (a2.pid(), 200 * MIB), (b.pid(), 600 * MIB), (c.pid(), 600 * MIB)] {
        let ebpf = metric(&all, "vramguard_ebpf_process_memory_bytes", &[("pid", &pid.to_string())]);
        assert_eq!(ebpf, Some(bytes as f64), "the eBPF view of pid {pid}");
    }
    let hami_a = [("namespace", "team-a"), ("pod", "trainer-0"), ("container", "main"), ("vdevice_index", "0"), ("zone", "vGPU")];
    assert_eq!(metric(&all, "hami_vgpu_memory_used_bytes", &hami_a), Some(used_a as f64));
    assert_eq!(metric(&all, "hami_vgpu_memory_limit_bytes", &hami_a), Some(QUOTA as f64));

    // B's refusal, as its ledger counts it.
    assert_eq!(Ledger::open(&ledger_b)?.device_usage()?[0].rejections, 1, "the hook refused b2 once");
    let rejections = |all: &[Sample], path: &Path| {
        of_ledger(all, "vramguard_container_rejections_total", path).first().map(|s| s.value)
    };
    assert_eq!(rejections(&all, &ledger_b), Some(1.0));
    assert_eq!(rejections(&all, &ledger_a), Some(0.0));

    // C: unhooked, then stopped before the allocation that would pass its 1 GiB.
    assert_eq!(state(&all, c.pid(), "unhooked"), Some(1.0));
    assert_eq!(state(&all, c.pid(), "ok"), Some(0.0));
    assert_eq!(metric(&all, "vramguard_unhooked_processes", &[]), Some(1.0));
    c.resume()?;
    let finished = c.wait()?;
    assert_eq!(finished.status.signal(), Some(libc::SIGKILL), "C stopped by SIGKILL: {:?}", finished.status);
    ensure!(finished.line("ok alloc c1 ").is_ok(), "C's first allocation went through: {:?}", finished.stdout);
    ensure!(!finished.stdout.iter().any(|l| l.starts_with("ok alloc c2")), "c2 never allocated: {:?}", finished.stdout);
    assert_eq!(node.used(0)?, 3 * CTX + 900 * MIB, "the fake driver never counted c2 (and C is gone)");
    let all = fresh_scrape(addr)?;
    ensure!(metric(&all, "vramguard_enforcement_signals_total", &[]).unwrap_or(0.0) >= 1.0, "the signal is counted");
    ensure!(metric(&all, "vramguard_over_limit_allocations_total", &[]).unwrap_or(0.0) >= 1.0, "c2 is counted");

    // SIGKILL one of A's processes: its slot and usage are reclaimed within 1 s.
    let a2_pid = a2.pid();
    a2.signal(libc::SIGKILL)?;
    let latency = wait_for(Duration::from_secs(1), "the killed A process's slot reclaimed", || {
        Ok(!ledgers::slots(&ledger_a)?.iter().any(|&(pid, _)| pid == a2_pid))
    })?;
    eprintln!("SIGKILL of one of A's processes to its slot reclaimed: {latency:?}");
    assert_eq!(ledgers::used(&ledger_a)?, CTX + 100 * MIB, "a2's usage went with its slot");
    drop(a2);
    let all = fresh_scrape(addr)?;
    assert_eq!(check_container(&all, &ledger_a, &a_labels, 100 * MIB)?, CTX + 100 * MIB);

    // a1 writes its own slot down to zero (done here from outside, through the file):
    // tampered, and only a1.
    let before = ledgers::zero_slot_bytes(&ledger_a, a1.pid())?;
    assert_eq!(before, 100 * MIB + CTX, "a1's allocation and its context reserve");
    let found = wait_for(Duration::from_secs(2), "the zeroed slot reported tampered", || {
        Ok(state(&scrape(addr)?, a1.pid(), "tampered") == Some(1.0))
    })?;
    eprintln!("slot zeroed to `tampered` in the metrics: {found:?}");
    let all = scrape(addr)?;
    assert_eq!(state(&all, a1.pid(), "ok"), Some(0.0));
    assert_eq!(state(&all, b.pid(), "ok"), Some(1.0), "B is unaffected");
    let audit = agent.audit()?;
    let row = audit["processes"]
        .as_array()
        .and_then(|rows| rows.iter().find(|r| r["pid"].as_u64() == Some(u64::from(a1.pid()))))
        .context("no audit row for a1")?;
    ensure!(row["state"] == "tampered" && row["ledger_bytes"] == 0, "{row}");

    drop((a1, b));
    agent.stop()?;
    Ok(())
}
