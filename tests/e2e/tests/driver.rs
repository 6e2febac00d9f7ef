//! The driver's view (issue 18, "Driver truth"): the agent reads NVML (here the fake's,
//! `libnvidia-ml.so.1` beside the `--libcuda` file) and joins each process's driver-reported
//! memory with the probes' and the ledgers' views. Real processes on the fake driver; the
//! agent gets the workloads' `FAKECUDA_*` so that its NVML sees their devices. Needs root;
//! run with `cargo xtask test`. Its agents probe its own fake driver alone (`--no-discover`),
//! except the two tests of what discovery leaves unprobed, which run alone.
use std::{
    ffi::{OsStr, OsString},
    os::unix::{fs::MetadataExt, process::ExitStatusExt},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use e2e::{
    agent::Agent,
    cgroup::{TestCgroup, SEPARATES_CONTAINERS},
    hostile::{Bystander, HealthProbe},
    http, wait_for, FakeNode, TempDir, GIB, MIB,
};
use serde_json::Value;

/// The fake's context (`FAKECUDA_CONTEXT_BYTES`), also the agent's `--context-allowance`
/// here: what an unknown process's context may hold on the fake's devices.
const CONTEXT: u64 = 64 * MIB;

/// The agent's arguments: the fake driver, discovery every 100 ms, ledgers under `dir`,
/// metrics and health listeners, and `more`.
fn args<'a>(libcuda: &'a Path, dir: &'a Path, more: &[&'a OsStr]) -> Vec<&'a OsStr> {
    let mut all = e2e::agent::watching_args(libcuda, dir);
    all.extend([OsStr::new("--context-allowance"), OsStr::new("64m")]);
    all.extend_from_slice(more);
    all
}

/// The (device, inode) of each file the agent probes, from an audit.
fn probed_files(audit: &Value) -> Result<Vec<(u64, u64)>> {
    let files = audit["libcuda"].as_array().context("no libcuda list")?;
    Ok(files.iter().filter_map(|f| Some((f["dev"].as_u64()?, f["ino"].as_u64()?))).collect())
}

/// Whether a line of the agent's log says `what` of process `pid`.
fn log_has(agent: &Agent, what: &str, pid: u32) -> bool {
    agent.log().lines().any(|l| l.contains(what) && l.contains(&format!("pid={pid} ")))
}

/// Process `pid`'s row of an audit.
fn row(audit: &Value, pid: u32) -> Option<Value> {
    audit["processes"].as_array()?.iter().find(|r| r["pid"].as_u64() == Some(u64::from(pid))).cloned()
}

/// A directory under `attacker` whose `libcuda.so.1` is a renamed copy of the fake driver
/// (`NAME.so`), and the copy's (device, inode).
fn renamed_copy(attacker: &TempDir, name: &str) -> Result<(PathBuf, (u64, u64))> {
    let renamed = attacker.path().join(format!("{name}.so"));
    std::fs::copy(e2e::fake_driver_lib()?, &renamed)?;
    let libs = attacker.path().join(format!("{name}-libs"));
    std::fs::create_dir(&libs)?;
    std::os::unix::fs::symlink(&renamed, libs.join("libcuda.so.1"))?;
    let meta = std::fs::metadata(&renamed)?;
    Ok((libs, (meta.dev(), meta.ino())))
}

/// Waits, within the 3 s, until `pid` is `unprobed` in `vramguard audit` with at
/// least 96 MiB of driver bytes and `ledger` charges `charged` bytes (the escaped memory
/// included); returns how long it took.
fn escaped_and_charged(agent: &Agent, pid: u32, ledger: &Path, charged: u64) -> Result<Duration> {
    let took = wait_for(Duration::from_secs(3), "the escaped process unprobed in vramguard audit and charged to its container's ledger", || {
        std::thread::sleep(Duration::from_millis(20));
        let audit = agent.audit()?;
        let seen = row(&audit, pid).is_some_and(|r| r["state"] == "unprobed" && r["driver_bytes"].as_u64().is_some_and(|b| b >= 96 * MIB));
        Ok(seen && e2e::ledgers::used(ledger)? == charged)
    })
    .with_context(|| format!("ledger charges {:?}; agent log:\n{}", e2e::ledgers::used(ledger), agent.log()))?;
    eprintln!("unprobed and charged {took:?} after the allocation");
    Ok(took)
}

/// A hooked process of the container refused an allocation that would fit its quota
/// (1 GiB) without the escaped memory charged (`own` charged before it, 64 MiB of its own
/// context), and granted one that fits with it.
fn a_hooked_process_sees_the_charge(node: &FakeNode, ledger: &Path, cgroup: &TestCgroup, own: u64, escaped: u64) -> Result<()> {
    let context = CONTEXT;
    let big = GIB - own - context - escaped / 2;
    let small = GIB - own - context - escaped - 64 * MIB;
    assert!(own + context + big <= GIB && own + context + escaped + big > GIB, "the sizes test nothing");
    let (big, small) = (format!("expect-oom alloc big {}m", big / MIB), format!("alloc small {}m", small / MIB));
    let late = node.hooked(ledger, GIB)?.in_cgroup(cgroup).steps(["ctx 0", big.as_str(), small.as_str()]).run()?.success()?;
    assert!(late.stdout.iter().any(|l| l.starts_with("ok alloc small")), "{:?}", late.stdout);
    assert!(late.stdout.iter().any(|l| l.starts_with("oom big")), "{:?}", late.stdout);
    Ok(())
}

/// A workload that loads a renamed copy of libcuda and allocates 96 MiB through it at once,
/// with no pause before the allocation, in a container whose files discovery may not probe
/// (`--max-probed-per-container 0`: the probes cannot see it, whatever the timing): within
/// 3 s `vramguard audit` shows it `unprobed` with at least 96 MiB of driver bytes, and its
/// container's ledger (that of a hooked process in the same cgroup) is charged with what the
/// driver reports it holding, so a new hooked process of the container is refused what
/// would fit without it; the metrics and the log say so. Negative control in the same
/// agent and container: the hooked, probed process holding the same is `ok`, its context not
/// counted twice.
///
/// Runs alone: its agent discovers libcuda on the whole node (it would probe the other test binaries' fake drivers).
#[test]
fn memory_allocated_through_an_unprobed_copy_is_seen_by_the_driver() -> Result<()> {
    let dir = TempDir::new("drv-ledgers")?;
    let attacker = TempDir::new("drv-attacker")?;
    let (libs, renamed_id) = renamed_copy(&attacker, "libnotcuda")?;

    let node = FakeNode::new("drv-renamed").with_env("FAKECUDA_CONTEXT_BYTES", "64m");
    let libcuda = e2e::fake_driver_dir()?.join("libcuda.so.1");
    let more = [OsStr::new("--rescan-ms"), OsStr::new("100"), OsStr::new("--max-probed-per-container"), OsStr::new("0")];
    let agent = Agent::start_with_env(&args(&libcuda, dir.path(), &more), node.env())?;

    // The negative control: hooked, under the agent's probes (the operator's file), in the
    // escaped process's container: its ledger is the container's.
    let cgroup = TestCgroup::create("drv-renamed")?;
    let ledger = dir.ledger("control")?;
    let control = e2e::holding(node.hooked(&ledger, GIB)?.in_cgroup(&cgroup), &["ctx 0", "alloc c 96m"])?;
    let own = CONTEXT + 96 * MIB;
    wait_for(Duration::from_secs(5), "the hooked process charged", || Ok(e2e::ledgers::used(&ledger)? == own))?;

    let mut escaped = node.workload().lib_dir(&libs).in_cgroup(&cgroup).steps(["ctx 0", "alloc a 96m", "checkpoint held", "hold"]).spawn()?;
    escaped.wait_checkpoint("held")?;
    let pid = escaped.pid();
    // All the driver reports (its context too: no ledger charges it) is charged.
    let escaped_bytes = 96 * MIB + CONTEXT;
    escaped_and_charged(&agent, pid, &ledger, own + escaped_bytes)?;
    a_hooked_process_sees_the_charge(&node, &ledger, &cgroup, own, escaped_bytes)?;

    let audit = agent.audit()?;
    assert_eq!(audit["driver"]["state"], "ok", "{}", audit["driver"]);
    let seen = row(&audit, pid).context("no row")?;
    // What the driver reports: the 96 MiB and the context, through a file no probe is on.
    assert_eq!(seen["driver_bytes"].as_u64(), Some(96 * MIB + CONTEXT), "{seen}");
    assert_eq!(seen["total_bytes"].as_u64().unwrap_or(0), 0, "the probes saw it after all: {seen}");
    let probed = probed_files(&audit)?;
    assert!(!probed.contains(&renamed_id), "the renamed copy was probed: {probed:?}");

    // The negative control: probed, in its ledger, the same driver figure: ok.
    let control_row = row(&audit, control.pid()).context("the hooked process is not in the audit")?;
    assert_eq!(control_row["state"], "ok", "{control_row}");
    assert_eq!(control_row["driver_bytes"].as_u64(), Some(96 * MIB + CONTEXT), "{control_row}");
    assert_eq!(control_row["total_bytes"].as_u64(), Some(96 * MIB), "{control_row}");

    let table = String::from_utf8_lossy(&agent.audit_table()?.stdout).into_owned();
    let line = table.lines().find(|l| l.trim_start().starts_with(&format!("{pid} "))).context("no table line")?.to_string();
    assert!(line.trim_end().ends_with("160.0 MiB  unprobed"), "{table}");
    assert!(table.contains("driver view (NVML): ok"), "{table}");

    let metrics = http::fresh_scrape(agent.metrics_addr()?)?;
    let p = pid.to_string();
    assert_eq!(http::metric(&metrics, "vramguard_process_state", &[("pid", &p), ("state", "unprobed")]), Some(1.0));
    assert_eq!(http::metric(&metrics, "vramguard_driver_process_memory_bytes", &[("pid", &p)]), Some((96 * MIB + CONTEXT) as f64));
    let c = control.pid().to_string();
    assert_eq!(http::metric(&metrics, "vramguard_process_state", &[("pid", &c), ("state", "ok")]), Some(1.0));
    assert_eq!(http::metric(&metrics, "vramguard_driver_up", &[]), Some(1.0));
    // Every process the driver reports is joined: nothing unattributed.
    assert_eq!(http::metric(&metrics, "vramguard_driver_unattributed_bytes", &[]), Some(0.0));
    let ledger_label = ledger.to_str().context("ledger path")?;
    let container = [("ledger", ledger_label)];
    assert_eq!(http::metric(&metrics, "vramguard_container_unaccounted_bytes", &container), Some(escaped_bytes as f64));
    // The hooked process (its context and 96 MiB) and the escaped one, per container.
    assert_eq!(http::metric(&metrics, "vramguard_container_driver_memory_bytes", &container), Some((own + escaped_bytes) as f64));

    let log = agent.log();
    let said = log.lines().filter(|l| l.contains("unprobed") && l.contains(&format!("pid={pid}"))).count();
    assert_eq!(said, 1, "one log line for the process: {log}");
    assert!(!log.lines().any(|l| l.contains("unprobed") && l.contains(&format!("pid={}", control.pid()))), "{log}");
    drop(escaped);
    drop(control);
    drop(agent);
    Ok(())
}

/// Five copies of libcuda loaded in one container and the allocation made through the fifth:
/// the first four take the container's probes (`--max-probed-per-container`, 4 by default),
/// so the fifth is capped and never probed. Within 3 s of its allocation the process is
/// `unprobed` with at least 96 MiB, and its container's ledger is charged with it, so a
/// hooked process of the container is refused what would fit without it.
///
/// Runs alone: its agent discovers libcuda on the whole node (it would probe the other test binaries' fake drivers).
#[test]
fn memory_allocated_through_a_fifth_copy_past_the_cap_is_seen_by_the_driver() -> Result<()> {
    let dir = TempDir::new("drv-fifth")?;
    let attacker = TempDir::new("drv-fifth-attacker")?;
    let copies = (1..=5).map(|i| renamed_copy(&attacker, &format!("libcopy{i}"))).collect::<Result<Vec<_>>>()?;
    let node = FakeNode::new("drv-fifth").with_env("FAKECUDA_CONTEXT_BYTES", "64m");
    let libcuda = e2e::fake_driver_dir()?.join("libcuda.so.1");
    let agent = Agent::start_with_env(&args(&libcuda, dir.path(), &[OsStr::new("--rescan-ms"), OsStr::new("100")]), node.env())?;
    let cgroup = TestCgroup::create("drv-fifth")?;
    let ledger = dir.ledger("fifth")?;
    let hooked = e2e::holding(node.hooked(&ledger, GIB)?.in_cgroup(&cgroup), &["ctx 0", "alloc h 96m"])?;
    let own = CONTEXT + 96 * MIB;
    wait_for(Duration::from_secs(5), "the hooked process charged", || Ok(e2e::ledgers::used(&ledger)? == own))?;

    // Four copies loaded in the container (mapped as ld.so maps them) take its probes.
    let mut steps: Vec<String> = copies[..4].iter().map(|(libs, _)| format!("map {}", libs.join("libcuda.so.1").display())).collect();
    steps.extend(["checkpoint mapped".to_string(), "hold".to_string()]);
    let mut loader = node.workload().in_cgroup(&cgroup).steps(steps).spawn()?;
    loader.wait_checkpoint("mapped")?;
    let four: Vec<(u64, u64)> = copies[..4].iter().map(|(_, id)| *id).collect();
    wait_for(e2e::timeout(), "the first four copies probed", || {
        let probed = probed_files(&agent.audit()?)?;
        Ok(four.iter().all(|id| probed.contains(id)))
    })
    .with_context(|| format!("agent log:\n{}", agent.log()))?;

    // The fifth: loaded and allocated through at once.
    let mut escaped = node.workload().lib_dir(&copies[4].0).in_cgroup(&cgroup).steps(["ctx 0", "alloc a 96m", "checkpoint held", "hold"]).spawn()?;
    escaped.wait_checkpoint("held")?;
    let escaped_bytes = 96 * MIB + CONTEXT;
    escaped_and_charged(&agent, escaped.pid(), &ledger, own + escaped_bytes)?;
    a_hooked_process_sees_the_charge(&node, &ledger, &cgroup, own, escaped_bytes)?;
    let audit = agent.audit()?;
    assert!(!probed_files(&audit)?.contains(&copies[4].1), "the fifth copy was probed: {}", audit["libcuda"]);
    let seen = row(&audit, escaped.pid()).context("no row")?;
    assert_eq!(seen["driver_bytes"].as_u64(), Some(escaped_bytes), "{seen}");
    let control = row(&audit, hooked.pid()).context("the hooked process is not in the audit")?;
    assert_eq!(control["state"], "ok", "{control}");
    drop((escaped, loader, hooked, agent));
    Ok(())
}

/// The scene of the signal tests: a renamed copy of libcuda (`libs`), a container limited to
/// 64 MiB (`over`) and one to 1 GiB (`under`) in a limits file, and the agent on them with
/// `--enforce signal`, probing its own fake driver alone (`--no-discover`: the copy is never
/// probed).
struct SignalScene {
    dir: TempDir,
    _attacker: TempDir,
    libs: PathBuf,
    over: TestCgroup,
    under: TestCgroup,
    node: FakeNode,
    agent: Agent,
}

impl SignalScene {
    /// `name` names the directories and the node, `cgroups` prefixes the two cgroups.
    fn start(name: &str, cgroups: &str) -> Result<SignalScene> {
        let dir = TempDir::new(name)?;
        let attacker = TempDir::new(&format!("{name}-attacker"))?;
        let (libs, _) = renamed_copy(&attacker, "libnotcuda")?;
        let over = TestCgroup::create(&format!("{cgroups}-over"))?;
        let under = TestCgroup::create(&format!("{cgroups}-under"))?;
        let limits = attacker.path().join("limits");
        std::fs::write(&limits, format!("{} 64m\n{} 1g\n", over.path, under.path))?;
        let node = FakeNode::new(name).with_env("FAKECUDA_CONTEXT_BYTES", "64m");
        let libcuda = e2e::fake_driver_dir()?.join("libcuda.so.1");
        let more = [
            OsStr::new("--no-discover"),
            OsStr::new("--limits"),
            limits.as_os_str(),
            OsStr::new("--enforce"),
            OsStr::new("signal"),
            OsStr::new(SEPARATES_CONTAINERS),
        ];
        let agent = Agent::start_with_env(&args(&libcuda, dir.path(), &more), node.env())?;
        Ok(SignalScene { dir, _attacker: attacker, libs, over, under, node, agent })
    }
}

/// With a cgroup limit pushed for the container (a limits file) and `--enforce signal`, an
/// escaped process (96 MiB through a copy no probe is on, and its 64 MiB context: 160 MiB the
/// probes never see, 94 MiB of it beyond a context at the allowance and a page) in a
/// container limited to 64 MiB is signalled (SIGKILL) by the agent; the negative control, the
/// same process in a container limited to 1 GiB, is not. Who escaped is who is stopped: a
/// probed process of the control's container that takes it over its limit only with the
/// escaped 94 MiB counted (800 MiB held, 150 MiB more: 950 MiB probed, 1044 MiB with them) is
/// let through by the entry probe, and the agent signals the control, whose memory the probes
/// cannot see.
#[test]
fn an_escaped_process_over_its_containers_limit_is_signalled() -> Result<()> {
    // The directories live as long as the test (the copy is loaded from one).
    let SignalScene { dir: _dir, _attacker, libs, over, under, node, agent } = SignalScene::start("drv-signal", "drv")?;
    let steps = ["ctx 0", "alloc a 96m", "checkpoint held", "hold"];
    let mut control = node.workload().lib_dir(&libs).in_cgroup(&under).steps(steps).spawn()?;
    control.wait_checkpoint("held")?;
    let mut escaped = node.workload().lib_dir(&libs).in_cgroup(&over).steps(steps).spawn()?;
    escaped.wait_checkpoint("held")?;
    let pid = escaped.pid();
    // It holds until something stops it (or the harness's timeout).
    let started = Instant::now();
    let finished = escaped.wait().with_context(|| format!("agent log:\n{}", agent.log()))?;
    assert_eq!(finished.status.signal(), Some(libc::SIGKILL), "stopped by SIGKILL: {:?}", finished.status);
    eprintln!("the escaped process over its limit was signalled {:?} after its allocation", started.elapsed());
    assert!(log_has(&agent, "signalled a process", pid), "{}", agent.log());
    assert!(Agent::stat(&agent.audit()?, "signals_sent") >= 1);

    // The control: unprobed, its 160 MiB within its 1 GiB, running two passes later.
    std::thread::sleep(Duration::from_secs(2));
    let audit = agent.audit()?;
    let seen = row(&audit, control.pid()).context("the control is not in the audit")?;
    assert_eq!((seen["state"].as_str(), seen["driver_bytes"].as_u64()), (Some("unprobed"), Some(96 * MIB + CONTEXT)), "{seen}");
    let state = std::fs::read_to_string(format!("/proc/{}/stat", control.pid()))?;
    let state = state.rsplit(')').next().and_then(|rest| rest.split_whitespace().next()).unwrap_or("?").to_string();
    assert!(state != "Z" && state != "X", "the control was stopped (state {state}): {}", agent.log());
    let signalled = |pid: u32| log_has(&agent, "signalled a process", pid);
    assert!(!signalled(control.pid()), "{}", agent.log());

    // A probed process of the control's container: its first 800 MiB fit beside the escaped
    // 94 MiB, the next 150 MiB pass the limit only with them counted: granted, and the
    // control is signalled.
    let mut neighbour = node.workload().in_cgroup(&under).steps(["ctx 0", "alloc a 800m", "checkpoint one", "alloc b 150m", "checkpoint two", "hold"]).spawn()?;
    neighbour.wait_checkpoint("one")?;
    neighbour.resume()?;
    neighbour.wait_checkpoint("two").with_context(|| format!("the neighbour was stopped; agent log:\n{}", agent.log()))?;
    let control_pid = control.pid();
    let finished = control.wait().with_context(|| format!("agent log:\n{}", agent.log()))?;
    assert_eq!(finished.status.signal(), Some(libc::SIGKILL), "the control stopped by SIGKILL: {:?}", finished.status);
    assert!(signalled(control_pid), "{}", agent.log());
    let neighbour_pid = neighbour.pid();
    let finished = neighbour.kill()?;
    assert!(finished.stdout.iter().any(|l| l.starts_with("ok alloc b")), "the neighbour's allocation was granted: {:?}", finished.stdout);
    assert!(!signalled(neighbour_pid), "{}", agent.log());
    agent.stop()?;
    Ok(())
}

/// A process that escapes the probes (96 MiB through a renamed copy of libcuda, and its
/// 64 MiB context: 160 MiB the probes never see, 94 MiB beyond a context at the allowance and
/// a page) under the hook, whose ledger slot it forges to say it holds all the driver reports
/// (160 MiB of data, through the file, before it allocates), is still held to its
/// container's limit: with `--enforce signal` and a 64 MiB limit it is signalled (SIGKILL) by the agent; its slot explains the memory to the ledger's
/// charge, never to the limit. The negative control, the same forged process in a container
/// limited to 1 GiB, is not signalled.
#[test]
fn a_slot_forged_up_to_the_drivers_figure_does_not_hide_an_escape_from_the_limit() -> Result<()> {
    let SignalScene { dir, _attacker, libs, over, under, node, agent } = SignalScene::start("drv-forged", "drv-forged")?;
    let steps = ["ctx 0", "checkpoint forge", "alloc a 96m", "checkpoint held", "hold"];
    // Each forges its slot (the hook's, in its own ledger) to the driver's whole figure
    // before it allocates, then allocates through the copy.
    let forged = |name: &str, cgroup: &TestCgroup| -> Result<(e2e::Running, PathBuf)> {
        let ledger = dir.ledger(name)?;
        let mut process = node.hooked(&ledger, GIB)?.lib_dir(&libs).in_cgroup(cgroup).steps(steps).spawn()?;
        process.wait_checkpoint("forge")?;
        let mut bytes = [0; ledger::layout::KINDS];
        bytes[ledger::Kind::Data as usize] = 96 * MIB + CONTEXT;
        e2e::ledgers::write_slot_bytes(&ledger, process.pid(), bytes)?;
        process.resume()?;
        process.wait_checkpoint("held")?;
        Ok((process, ledger))
    };
    let (control, control_ledger) = forged("control", &under)?;
    let (escaped, _) = forged("escaped", &over)?;
    let pid = escaped.pid();
    let signalled = |pid: u32| log_has(&agent, "signalled a process", pid);
    wait_for(Duration::from_secs(10), "the escaped process with a forged slot signalled", || {
        std::thread::sleep(Duration::from_millis(50));
        Ok(signalled(pid))
    })
    .with_context(|| format!("audit: {:?}\nagent log:\n{}", agent.audit().map(|a| row(&a, pid)), agent.log()))?;
    let finished = escaped.wait()?;
    assert_eq!(finished.status.signal(), Some(libc::SIGKILL), "stopped by SIGKILL: {:?}", finished.status);

    // The control: its forged slot holds (the ledger explains the memory to the charge), it
    // is seen by the driver, and it runs two passes later, not signalled.
    std::thread::sleep(Duration::from_secs(2));
    let audit = agent.audit()?;
    let seen = row(&audit, control.pid()).context("the control is not in the audit")?;
    assert_eq!(seen["driver_bytes"].as_u64(), Some(96 * MIB + CONTEXT), "{seen}");
    let slot = ledger::Ledger::open(&control_ledger)?.slots()?.into_iter().find(|v| v.slot.pid == control.pid()).context("the control's slot")?;
    assert!(slot.slot.devices[0].bytes[ledger::Kind::Data as usize] >= 96 * MIB + CONTEXT, "{:?}", slot.slot.devices[0]);
    let state = std::fs::read_to_string(format!("/proc/{}/stat", control.pid()))?;
    let state = state.rsplit(')').next().and_then(|rest| rest.split_whitespace().next()).unwrap_or("?").to_string();
    assert!(state != "Z" && state != "X", "the control was stopped (state {state}): {}", agent.log());
    assert!(!signalled(control.pid()), "{}", agent.log());
    drop(control);
    agent.stop()?;
    Ok(())
}

/// Without NVML (a file that is no library, a driver not loaded, NVML answering errors, NVML
/// hanging for 10 s) the agent starts, reclaims another container's dead process within a
/// second, answers `/healthz` throughout, and says why in audit (`driver`), the metrics and
/// once in the log.
///
/// Bounds latency: `/healthz` within 250 ms while NVML fails or hangs.
#[test]
fn without_nvml_the_agent_runs_and_says_why() -> Result<()> {
    let broken = TempDir::new("drv-broken")?;
    let not_a_library = broken.path().join("libnvidia-ml.so.1");
    std::fs::write(&not_a_library, b"not an ELF file")?;
    /// (name, --nvml, the fake's knobs, the state, a word of the reason).
    type Case<'a> = (&'a str, Option<&'a Path>, &'a [(&'a str, &'a str)], &'a str, &'a str);
    let cases: [Case; 4] = [
        ("broken", Some(&not_a_library), &[], "absent", "cannot load"),
        ("absent", None, &[("FAKECUDA_NVML", "absent")], "absent", "Driver Not Loaded"),
        ("fail", None, &[("FAKECUDA_NVML", "fail")], "failing", "Unknown Error"),
        ("hang", None, &[("FAKECUDA_NVML", "hang"), ("FAKECUDA_NVML_HANG_MS", "10000")], "hung", "has not returned"),
    ];
    let libcuda = e2e::fake_driver_dir()?.join("libcuda.so.1");
    for (name, nvml, knobs, state, reason) in cases {
        let dir = TempDir::new(&format!("drv-{name}"))?;
        let mut node = FakeNode::new(&format!("drv-{name}"));
        for (key, value) in knobs {
            node = node.with_env(*key, *value);
        }
        let mut more: Vec<&OsStr> = vec![OsStr::new("--no-discover")];
        if let Some(path) = nvml {
            more.extend([OsStr::new("--nvml"), path.as_os_str()]);
        }
        let started = Instant::now();
        let env: Vec<(OsString, OsString)> = node.env().to_vec();
        let agent = Agent::start_with_env(&args(&libcuda, dir.path(), &more), &env).with_context(|| format!("{name}: the agent did not start"))?;
        let health = HealthProbe::start(agent.health_addr()?, Duration::from_millis(250));
        wait_for(Duration::from_secs(6), &format!("{name}: audit says the driver view is {state}"), || {
            std::thread::sleep(Duration::from_millis(50));
            Ok(agent.audit()?["driver"]["state"] == state)
        })
        .with_context(|| format!("agent log:\n{}", agent.log()))?;
        let audit = agent.audit()?;
        let said = audit["driver"]["reason"].as_str().unwrap_or("");
        assert!(said.contains(reason), "{name}: {}", audit["driver"]);

        let mut bystander = Bystander::start(&node, &dir, &agent)?;
        bystander.kill_and_expect_reclaim(&agent).with_context(|| format!("{name}: reclaim"))?;

        let metrics = http::fresh_scrape(agent.metrics_addr()?)?;
        assert_eq!(http::metric(&metrics, "vramguard_driver_up", &[]), Some(0.0), "{name}");
        assert_eq!(http::metric(&metrics, "vramguard_driver_state", &[("state", state)]), Some(1.0), "{name}");
        let labelled = http::samples(&metrics, "vramguard_driver_state").any(|s| s.label("reason").contains(reason));
        assert!(labelled, "{name}: no reason label with {reason:?}");
        // For the hanging NVML: ten seconds of it, health answering throughout.
        if name == "hang" {
            std::thread::sleep(Duration::from_secs(10).saturating_sub(started.elapsed()));
            assert_eq!(agent.audit()?["driver"]["state"], "hung");
        }
        let answered = health.finish().with_context(|| format!("{name}: /healthz"))?;
        let log = agent.stop().with_context(|| format!("{name}: stopping"))?;
        let unavailable = log.lines().filter(|l| l.contains("driver view unavailable")).count();
        if unavailable != 1 {
            bail!("{name}: {unavailable} log lines about the driver view, not one:\n{log}");
        }
        eprintln!("{name}: {state} ({said}); /healthz answered {answered} times");
    }
    Ok(())
}

/// SIGKILLs a process this test started indirectly (through `unshare`) when dropped.
struct KillOnDrop(u32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        // SAFETY: kill(2) on the pid of the workload this test started (found as unshare's child).
        unsafe { libc::kill(self.0 as i32, libc::SIGKILL) };
    }
}

/// A process in a pid namespace of its own (as a container's) is reported by its host pid,
/// the pid the agent sees (the fake's NVML, as the real one, answers in the caller's
/// namespace): its row is its host pid's, and no row is made for the pid it has inside.
#[test]
fn a_process_in_another_pid_namespace_is_joined_by_its_host_pid() -> Result<()> {
    let dir = TempDir::new("drv-pidns")?;
    let node = FakeNode::new("drv-pidns").with_env("FAKECUDA_CONTEXT_BYTES", "64m");
    let libcuda = e2e::fake_driver_dir()?.join("libcuda.so.1");
    let agent = Agent::start_with_env(&args(&libcuda, dir.path(), &[OsStr::new("--no-discover")]), node.env())?;
    // Unprobed by construction: the agent probes the fake driver's file, the workload maps a
    // copy of it.
    let copy = dir.path().join("copy");
    std::fs::create_dir(&copy)?;
    std::fs::copy(e2e::fake_driver_lib()?, copy.join("libcuda.so.1"))?;
    let mut inside = node
        .workload()
        .lib_dir(&copy)
        // --kill-child: the workload (the namespace's init) dies with unshare, which the
        // harness kills; without it the workload would outlive the test.
        .wrapped("unshare", ["--pid", "--fork", "--kill-child", "--mount-proc"])
        .steps(["ctx 0", "alloc a 96m", "checkpoint held", "hold"])
        .spawn()?;
    inside.wait_checkpoint("held")?;
    // The workload is unshare's child: its host pid.
    let children = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", inside.pid()))?;
    let host_pid: u32 = children.split_whitespace().next().context("unshare has no child")?.parse()?;
    let _reaper = KillOnDrop(host_pid);
    let status = std::fs::read_to_string(format!("/proc/{host_pid}/status"))?;
    let nspid = status.lines().find(|l| l.starts_with("NSpid:")).context("no NSpid")?.to_string();
    let inner: u32 = nspid.split_whitespace().last().context("empty NSpid")?.parse()?;
    assert_ne!(inner, host_pid, "not in a pid namespace of its own: {nspid}");
    wait_for(Duration::from_secs(3), "the namespaced process unprobed under its host pid", || {
        std::thread::sleep(Duration::from_millis(20));
        Ok(row(&agent.audit()?, host_pid).is_some_and(|r| r["state"] == "unprobed"))
    })
    .with_context(|| format!("agent log:\n{}", agent.log()))?;
    let audit = agent.audit()?;
    let seen = row(&audit, host_pid).context("no row")?;
    assert_eq!(seen["driver_bytes"].as_u64(), Some(96 * MIB + CONTEXT), "{seen}");
    if let Some(other) = row(&audit, inner) {
        assert!(other["driver_bytes"].is_null(), "the inner pid {inner} got the driver's figure: {other}");
    }
    drop(inside);
    drop(agent);
    Ok(())
}
