//! Hostile tenants against libcuda discovery (issue "Hostile tenants", item 2): each attack is
//! a real process in a cgroup of its own, and while it runs the agent must stay up and serving
//! (`assert_serving`) and reclaim a killed process of another container within a second
//! ([`Bystander`]). What each attack must not achieve is checked against the probed set the
//! agent reports (`vramguard audit --json`: `libcuda[].dev/ino`). Needs root; run with
//! `cargo xtask test`.
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
    hostile::{assert_serving, Bystander},
    wait_for, FakeNode, TempDir, MIB,
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
