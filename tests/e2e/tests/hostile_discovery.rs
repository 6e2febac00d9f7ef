//! Hostile tenants against libcuda discovery (issue "Hostile tenants", item 2): each attack is
//! a real process in a cgroup of its own, and while it runs the agent must stay up and serving
//! (`assert_serving`) and reclaim a killed process of another container within a second
//! ([`Bystander`]). What each attack must not achieve is checked against the probed set the
//! agent reports (`vramguard audit --json`: `libcuda[].dev/ino`). Needs root; run with
//! `cargo xtask test`.
//!
//! Runs alone: its agents discover libcuda on the whole node, and it bounds /healthz's latency under attack.
use std::{
    ffi::OsStr,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use e2e::{
    agent::Agent,
    cgroup::TestCgroup,
    hostile::{assert_serving, Bystander, HealthProbe},
    http, wait_for, FakeNode, TempDir, MIB,
};
use serde_json::Value;

type FileId = (u64, u64);

fn id_of(path: &Path) -> Result<FileId> {
    let metadata = std::fs::metadata(path).with_context(|| format!("stat {}", path.display()))?;
    Ok((metadata.dev(), metadata.ino()))
}

/// An agent probing the fake driver (`--libcuda`) and discovering (every 100 ms) whatever
/// else processes map, watching the ledgers under `dir`, serving metrics.
fn discovering_agent(dir: &TempDir) -> Result<Agent> {
    let libcuda = e2e::fake_driver_dir()?.join("libcuda.so.1");
    Agent::start_with(&[
        OsStr::new("--libcuda"),
        libcuda.as_os_str(),
        OsStr::new("--ledger-dir"),
        dir.path().as_os_str(),
        OsStr::new("--metrics-addr"),
        OsStr::new("127.0.0.1:0"),
        OsStr::new("--health-addr"),
        OsStr::new("127.0.0.1:0"),
        OsStr::new("--rescan-ms"),
        OsStr::new("100"),
    ])
}

/// The (dev, ino) of every file the agent has probes on.
fn probed(agent: &Agent) -> Result<Vec<FileId>> {
    Ok(probed_with_cgroups(agent)?.into_iter().map(|(id, _)| id).collect())
}

/// The (dev, ino) of every file the agent has probes on, with the cgroup id of the process
/// it was discovered in (`None` for the operator's files).
fn probed_with_cgroups(agent: &Agent) -> Result<Vec<(FileId, Option<u64>)>> {
    let audit = agent.audit()?;
    let files = audit["libcuda"].as_array().context("no libcuda list in the audit")?;
    files
        .iter()
        .map(|f| Ok(((f["dev"].as_u64().context("no dev")?, f["ino"].as_u64().context("no ino")?), f["cgroup"].as_u64())))
        .collect()
}

/// A library that has nothing to do with CUDA: this test process's own libc.
fn system_library() -> Result<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps")?;
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .find(|path| path.rsplit('/').next().is_some_and(|name| name.starts_with("libc.so")))
        .map(PathBuf::from)
        .context("this process maps no libc.so")
}

/// Fails if a file of `never` is probed, or a file found in cgroup `attacker` is not one of
/// `own` (other processes of this shared machine may map libcuda copies of their own).
fn probed_within(agent: &Agent, attacker: u64, own: &[FileId], never: &[FileId], what: &str) -> Result<Vec<FileId>> {
    let now = probed_with_cgroups(agent)?;
    let stray = now.iter().find(|(id, cgroup)| never.contains(id) || (*cgroup == Some(attacker) && !own.contains(id)));
    if let Some(stray) = stray {
        bail!("{what}: the agent probed {stray:?} (attacker's own: {own:?}); its log:\n{}", agent.log());
    }
    Ok(now.into_iter().map(|(id, _)| id).collect())
}

/// The attacker maps a library through a directory it keeps exchanging with a symlink to a
/// host directory holding a libcuda that nobody maps. Resolving the mapped path (what the
/// agent used to do, three times) lands on the host's file part of the time; the agent must
/// only ever probe files the attacker really maps (its own libcuda copy), never the host's.
#[test]
fn a_symlink_swapped_during_discovery_never_gets_another_file_probed() -> Result<()> {
    let dir = TempDir::new("hd-swap-ledgers")?;
    let attacker = TempDir::new("hd-swap-attacker")?;
    let host = TempDir::new("hd-swap-host")?;
    let fake = e2e::fake_driver_lib()?;
    // The host's libcuda: a libcuda by content, mapped by no process.
    let host_libcuda = host.path().join("libcuda.so.1");
    std::fs::copy(&fake, &host_libcuda)?;
    // The attacker's own files: a libcuda copy it maps (fair game for probes), and a
    // non-CUDA library named libcuda.so.1 in the directory it swaps.
    let own = attacker.path().join("libnotcuda.so");
    std::fs::copy(&fake, &own)?;
    let swapped_dir = attacker.path().join("lib");
    std::fs::create_dir(&swapped_dir)?;
    let decoy = swapped_dir.join("libcuda.so.1");
    std::fs::copy(system_library()?, &decoy)?;
    let link = attacker.path().join("alt");
    std::os::unix::fs::symlink(host.path(), &link)?;
    let ids = (id_of(&host_libcuda)?, id_of(&own)?, id_of(&decoy)?);

    let agent = discovering_agent(&dir)?;
    let node = FakeNode::new("hd-swap");
    let mut bystander = Bystander::start(&node, &dir, &agent)?;
    let cgroup = TestCgroup::create("hd-swap")?;
    let mut attack = node
        .workload()
        .in_cgroup(&cgroup)
        .steps([
            format!("map {}", own.display()),
            format!("map {}", decoy.display()),
            "checkpoint mapped".into(),
            format!("swap {} {}", swapped_dir.display(), link.display()),
        ])
        .spawn()?;
    attack.wait_checkpoint("mapped")?;
    attack.resume()?;
    attack.expect_prefix("swap started")?;

    // Negative control: the attack works on a path lookup. Through the process's root, the
    // path its maps show for the decoy reaches the host's libcuda part of the time.
    let root = PathBuf::from(format!("/proc/{}/root", attack.pid()));
    let mut redirected = 0;
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(3) && redirected == 0 {
        let maps = std::fs::read_to_string(format!("/proc/{}/maps", attack.pid()))?;
        for path in maps.lines().filter_map(|l| l.split_whitespace().nth(5)).filter(|p| p.ends_with("/libcuda.so.1")) {
            if id_of(&root.join(path.trim_start_matches('/'))).ok() == Some(ids.0) {
                redirected += 1;
            }
        }
    }
    assert!(redirected > 0, "the swap never redirected a lookup of the mapped path: the attack is not running");

    // During the attack (full scans every second): neither the host's file nor the decoy is
    // ever probed, and of the attacker's container only its own libcuda copy, which is found.
    let (own_ids, never) = ([ids.1], [ids.0, ids.2]);
    let deadline = Instant::now() + Duration::from_secs(4);
    let mut kills = 0;
    while Instant::now() < deadline {
        probed_within(&agent, cgroup.id, &own_ids, &never, "during the symlink swap")?;
        assert_serving(&agent)?;
        if kills < 2 {
            bystander.kill_and_expect_reclaim(&agent)?;
            kills += 1;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    wait_for(Duration::from_secs(5), "the attacker's own libcuda copy probed", || Ok(probed(&agent)?.contains(&ids.1)))?;
    let now = probed_within(&agent, cgroup.id, &own_ids, &never, "after the symlink swap")?;
    assert!(!now.contains(&ids.0) && !now.contains(&ids.2), "{now:?}");
    assert_eq!(attack.stderr(), "", "the attacker kept swapping");
    drop(attack);
    // Killed, not stopped: a discovering agent on this shared machine also probes other
    // tests' driver copies, and detaching each probe waits for an RCU grace period, which
    // can take the SIGTERM shutdown past the harness's 10 s on a loaded machine.
    drop(agent);
    Ok(())
}

/// A process maps a file named libcuda.so.1 that is not an ELF file before the agent
/// starts: the agent starts, says it skipped the file and why, and works.
#[test]
fn a_non_elf_libcuda_mapped_at_start_is_skipped_with_its_reason() -> Result<()> {
    let dir = TempDir::new("hd-nonelf-ledgers")?;
    let attacker = TempDir::new("hd-nonelf-attacker")?;
    let junk = attacker.path().join("libcuda.so.1");
    std::fs::write(&junk, (0..65536u32).map(|i| (i.wrapping_mul(2654435761) >> 24) as u8).collect::<Vec<u8>>())?;
    let node = FakeNode::new("hd-nonelf");
    let cgroup = TestCgroup::create("hd-nonelf")?;
    let mut attack = node
        .workload()
        .in_cgroup(&cgroup)
        .steps([format!("map {}", junk.display()), "checkpoint mapped".into(), "hold".into()])
        .spawn()?;
    attack.wait_checkpoint("mapped")?;

    // Negative control: given by the operator, the same file is an error.
    let output = std::process::Command::new(e2e::agent::agent_bin()?)
        .args(["run", "--no-discover", "--socket", "/tmp/vramguard-e2e-nonelf.sock", "--libcuda"])
        .arg(&junk)
        .output()?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success() && stderr.contains("not a 64-bit ELF"), "{stderr}");

    let agent = discovering_agent(&dir).context("the agent must start beside a non-ELF libcuda.so.1")?;
    let junk_id = id_of(&junk)?;
    let audit = agent.audit()?;
    let skipped = audit["discovery"]["skipped"].as_array().context("no discovery.skipped in the audit")?;
    let entry = skipped
        .iter()
        .find(|s| (s["dev"].as_u64(), s["ino"].as_u64()) == (Some(junk_id.0), Some(junk_id.1)))
        .with_context(|| format!("the file is not listed as skipped: {audit}"))?;
    assert!(entry["reason"].as_str().is_some_and(|r| r.contains("not a 64-bit ELF")), "{entry}");
    let log = agent.log();
    assert!(
        log.lines().any(|l| l.contains("skipped a mapped file") && l.contains(&*junk.to_string_lossy()) && l.contains("not a 64-bit ELF")),
        "no log line with the file and the reason:\n{log}"
    );
    assert!(!probed(&agent)?.contains(&junk_id));
    assert!(audit["discovery"]["failed"].as_u64().is_some_and(|n| n >= 1), "{audit}");

    let mut bystander = Bystander::start(&node, &dir, &agent)?;
    assert_serving(&agent)?;
    bystander.kill_and_expect_reclaim(&agent)?;
    assert_serving(&agent)?;
    // Remembered: not read again at the full scans that follow.
    std::thread::sleep(Duration::from_millis(1500));
    let lines = agent.log().lines().filter(|l| l.contains("skipped a mapped file") && l.contains(&*junk.to_string_lossy())).count();
    assert_eq!(lines, 1, "the failure is logged once, not at every scan");
    drop(attack);
    // Killed, not stopped: a discovering agent on this shared machine also probes other
    // tests' driver copies, and detaching each probe waits for an RCU grace period, which
    // can take the SIGTERM shutdown past the harness's 10 s on a loaded machine.
    drop(agent);
    Ok(())
}

/// An un-hooked workload loads a renamed copy of the driver (`libnotcuda.so`): the agent
/// probes it by its exports and the workload's allocations appear in `audit` as `unhooked`.
/// Negative controls: a non-CUDA library the workload maps, and the hook the bystander maps
/// (it exports the allocation functions, not cuInit), are not probed.
#[test]
fn a_renamed_libcuda_is_probed_and_its_allocations_audited() -> Result<()> {
    let dir = TempDir::new("hd-renamed-ledgers")?;
    let attacker = TempDir::new("hd-renamed-attacker")?;
    let renamed = attacker.path().join("libnotcuda.so");
    std::fs::copy(e2e::fake_driver_lib()?, &renamed)?;
    // What dlopen("libcuda.so.1") finds first: the maps show the file's own name.
    let libs = attacker.path().join("libs");
    std::fs::create_dir(&libs)?;
    std::os::unix::fs::symlink(&renamed, libs.join("libcuda.so.1"))?;
    let other = attacker.path().join("libcuda.so.2");
    std::fs::copy(system_library()?, &other)?;
    let ids = (id_of(&renamed)?, id_of(&other)?, id_of(&e2e::hook_lib()?)?);

    let agent = discovering_agent(&dir)?;
    let node = FakeNode::new("hd-renamed");
    let mut bystander = Bystander::start(&node, &dir, &agent)?;
    let cgroup = TestCgroup::create("hd-renamed")?;
    let mut workload = node
        .workload()
        .lib_dir(&libs)
        .in_cgroup(&cgroup)
        .steps([
            format!("map {}", other.display()),
            "checkpoint loaded".into(),
            "ctx 0".into(),
            "alloc a 300m".into(),
            "checkpoint held".into(),
            "hold".into(),
        ])
        .spawn()?;
    workload.wait_checkpoint("loaded")?;
    wait_for(Duration::from_secs(5), "the renamed copy probed", || Ok(probed(&agent)?.contains(&ids.0)))?;
    workload.resume()?;
    workload.wait_checkpoint("held")?;
    bystander.kill_and_expect_reclaim(&agent)?;
    assert_serving(&agent)?;

    let pid = workload.pid();
    let row = |audit: &Value| audit["processes"].as_array().and_then(|rows| rows.iter().find(|r| r["pid"].as_u64() == Some(pid as u64)).cloned());
    wait_for(Duration::from_secs(3), "the workload judged", || Ok(row(&agent.audit()?).is_some_and(|r| r["state"].is_string())))?;
    let audit = agent.audit()?;
    let row = row(&audit).context("the workload's allocations are not in the audit")?;
    assert_eq!(row["state"], "unhooked", "{row}");
    assert_eq!(row["total_bytes"].as_u64(), Some(300 * MIB), "{row}");
    assert_eq!(row["bytes"]["device"].as_u64(), Some(300 * MIB), "{row}");
    let now = probed(&agent)?;
    assert!(!now.contains(&ids.1), "a non-CUDA library was probed: {now:?}");
    assert!(!now.contains(&ids.2), "the hook was probed: {now:?}");
    drop(workload);
    // Killed, not stopped: a discovering agent on this shared machine also probes other
    // tests' driver copies, and detaching each probe waits for an RCU grace period, which
    // can take the SIGTERM shutdown past the harness's 10 s on a loaded machine.
    drop(agent);
    Ok(())
}

/// How often `/healthz` is asked while an attack runs (each answer within
/// [`e2e::hostile::HEALTH_WITHIN`], 250 ms).
const HEALTH_EVERY: Duration = Duration::from_millis(250);

/// The agent's peak resident memory (`VmHWM`), in bytes.
fn peak_rss(agent: &Agent) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{}/status", agent.pid()))?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).context("no VmHWM")?;
    let kib: u64 = line.split_whitespace().nth(1).context("no VmHWM figure")?.parse()?;
    Ok(kib * 1024)
}

/// `vramguard audit`'s `discovery.skipped` entry for file `id`, if any.
fn skipped_entry(agent: &Agent, id: FileId) -> Result<Option<Value>> {
    let audit = agent.audit()?;
    let skipped = audit["discovery"]["skipped"].as_array().context("no discovery.skipped in the audit")?;
    Ok(skipped.iter().find(|s| (s["dev"].as_u64(), s["ino"].as_u64()) == (Some(id.0), Some(id.1))).cloned())
}

/// `setpriv` arguments that run the workload as nobody (uid and gid 65534, no groups).
fn as_nobody() -> [&'static str; 3] {
    ["--reuid=65534", "--regid=65534", "--clear-groups"]
}

/// Crafted ELF files (the issue's: 174,762 symbols, 4 MiB of names without a NUL byte, no
/// hash table; and one whose `.gnu.hash` puts every symbol in one endless chain of the hash
/// of `cuInit`) mapped executable by an unprivileged process, one before the agent starts,
/// one while it runs: `/healthz` answers within 2 s of the start and then every 250 ms, each
/// file is listed in `audit` with the bound it broke. Negative control: a copy of the fake
/// driver mapped the same way by the same process is probed, and not listed.
#[test]
fn crafted_elf_files_never_keep_the_agent_from_answering() -> Result<()> {
    use e2e::crafted_elf::{Crafted, Hash, Names, MOST_SYMBOLS};
    let dir = TempDir::new("hd-elf-ledgers")?;
    let attacker = TempDir::new("hd-elf-attacker")?;
    let before = attacker.path().join("libcuda.so.1");
    std::fs::write(&before, Crafted::new(MOST_SYMBOLS, Names::WithoutNul, Hash::None).bytes())?;
    let during = attacker.path().join("libchain.so");
    std::fs::write(&during, Crafted::new(MOST_SYMBOLS, Names::Proper, Hash::GnuOneChain).bytes())?;
    let control = attacker.path().join("libnotcuda.so");
    std::fs::copy(e2e::fake_driver_lib()?, &control)?;
    let ids = (id_of(&before)?, id_of(&during)?, id_of(&control)?);

    let node = FakeNode::new("hd-elf");
    let cgroup = TestCgroup::create("hd-elf")?;
    let map = |files: &[&Path]| -> Result<e2e::Running> {
        let mut steps: Vec<String> = files.iter().map(|f| format!("map {}", f.display())).collect();
        steps.extend(["checkpoint mapped".into(), "hold".into()]);
        let mut running = node.workload().in_cgroup(&cgroup).wrapped("setpriv", as_nobody()).steps(steps).spawn()?;
        running.wait_checkpoint("mapped")?;
        Ok(running)
    };
    let first = map(&[&before, &control])?;

    let started = Instant::now();
    let agent = discovering_agent(&dir)?;
    let health = agent.health_addr()?;
    wait_for(Duration::from_secs(2).saturating_sub(started.elapsed()), "/healthz answered within 2 s of the agent's start", || {
        Ok(http::get(health, "/healthz").is_ok_and(|(status, _)| status == 200))
    })
    .with_context(|| format!("agent log:\n{}", agent.log()))?;
    eprintln!("/healthz answered {:?} after the start", started.elapsed());
    let probe = HealthProbe::start(health, HEALTH_EVERY);

    let reason = |entry: Option<Value>| entry.and_then(|e| e["reason"].as_str().map(String::from));
    wait_for(Duration::from_secs(5), "the file mapped before the start reported", || Ok(skipped_entry(&agent, ids.0)?.is_some()))?;
    wait_for(Duration::from_secs(5), "the fake driver's copy probed", || Ok(probed(&agent)?.contains(&ids.2)))?;
    std::thread::sleep(Duration::from_secs(1));
    let second = map(&[&during])?;
    wait_for(Duration::from_secs(5), "the file mapped while it runs reported", || Ok(skipped_entry(&agent, ids.1)?.is_some()))?;
    std::thread::sleep(Duration::from_secs(2));
    let probes = probe.finish().with_context(|| format!("agent log:\n{}", agent.log()))?;
    assert!(probes >= 12, "{probes} probes");

    let first_reason = reason(skipped_entry(&agent, ids.0)?).context("no reason")?;
    assert!(first_reason.contains("without a hash table") && first_reason.contains("65536"), "{first_reason}");
    let second_reason = reason(skipped_entry(&agent, ids.1)?).context("no reason")?;
    assert!(second_reason.contains(".gnu.hash chain"), "{second_reason}");
    assert!(skipped_entry(&agent, ids.2)?.is_none(), "the fake driver's copy was reported: {}", agent.audit()?);
    let now = probed(&agent)?;
    assert!(!now.contains(&ids.0) && !now.contains(&ids.1), "a crafted file was probed: {now:?}");
    assert_serving(&agent)?;
    drop((first, second));
    // Killed, not stopped (see above).
    drop(agent);
    Ok(())
}

/// An unprivileged process maps the first page of one file 64,000 times under a 3.8 KB path
/// (a 250 MB `/proc/<pid>/maps`) before the agent starts: the agent keeps answering
/// `/healthz` every 250 ms, reports the process as over the bound, and its peak RSS stays
/// under 128 MiB. The figure: the DaemonSet's limit is 256 Mi; the agent reads at most 16 MiB
/// of one process's maps, a line at a time through a 64 KiB buffer, so its peak is its own
/// working set (tens of MiB in a debug build) and nothing of the maps; half the limit leaves
/// room for the agent's growth elsewhere and still fails a reader that holds the maps whole
/// (250 MB). Negative control: the attack is real (the test reads the maps' size).
#[test]
fn a_bloated_maps_file_costs_the_agent_no_memory() -> Result<()> {
    const MAPPINGS: u64 = 64_000;
    const PEAK: u64 = 128 * MIB;
    let limit: u64 = std::fs::read_to_string("/proc/sys/vm/max_map_count")?.trim().parse()?;
    assert!(limit > MAPPINGS + 1000, "vm.max_map_count is {limit}: the attack needs {MAPPINGS} mappings");
    let dir = TempDir::new("hd-maps-ledgers")?;
    let attacker = TempDir::new("hd-maps-attacker")?;
    // A path of about 3.8 KB: 15 directories of 250 characters.
    let mut deep = attacker.path().to_path_buf();
    for i in 0..15 {
        deep.push(format!("{i:02}{}", "d".repeat(248)));
    }
    std::fs::create_dir_all(&deep)?;
    let file = deep.join("page");
    std::fs::write(&file, vec![0u8; 4096])?;
    assert!(file.as_os_str().len() > 3700, "{}", file.as_os_str().len());

    let node = FakeNode::new("hd-maps");
    let cgroup = TestCgroup::create("hd-maps")?;
    let mut attack = node
        .workload()
        .in_cgroup(&cgroup)
        .wrapped("setpriv", as_nobody())
        .steps([format!("map-many {MAPPINGS} {}", file.display()), "checkpoint mapped".into(), "hold".into()])
        .spawn()?;
    attack.wait_checkpoint("mapped")?;
    let maps_bytes = std::io::copy(&mut std::fs::File::open(format!("/proc/{}/maps", attack.pid()))?, &mut std::io::sink())?;
    eprintln!("the attacker's maps: {} MiB", maps_bytes / MIB);
    assert!(maps_bytes > 200 * MIB, "the attack is not running: its maps are {maps_bytes} bytes");

    let agent = discovering_agent(&dir)?;
    let probe = HealthProbe::start(agent.health_addr()?, HEALTH_EVERY);
    let pid = attack.pid() as u64;
    let reported = |agent: &Agent| -> Result<Option<Value>> {
        let audit = agent.audit()?;
        let skipped = audit["discovery"]["skipped"].as_array().context("no discovery.skipped")?.clone();
        Ok(skipped.into_iter().find(|s| s["path"].as_str() == Some(&*format!("/proc/{pid}/maps"))))
    };
    wait_for(Duration::from_secs(5), "the process reported as over the bound", || Ok(reported(&agent)?.is_some()))?;
    // Two full scans more (every second): it is not read again.
    std::thread::sleep(Duration::from_millis(2500));
    probe.finish().with_context(|| format!("agent log:\n{}", agent.log()))?;
    let entry = reported(&agent)?.context("reported")?;
    assert!(entry["reason"].as_str().is_some_and(|r| r.contains("over the agent's bound")), "{entry}");
    let audit = agent.audit()?;
    assert_eq!(audit["discovery"]["maps_over_bound"].as_u64(), Some(1), "reported once: {}", audit["discovery"]);
    let peak = peak_rss(&agent)?;
    eprintln!("agent peak RSS: {} MiB", peak / MIB);
    assert!(peak < PEAK, "the agent's peak RSS is {} MiB, over {} MiB", peak / MIB, PEAK / MIB);
    assert_serving(&agent)?;
    drop(attack);
    drop(agent);
    Ok(())
}
