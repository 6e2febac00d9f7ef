//! The hook in a provisioned container (issue "Quotas belong to the operator", item 4),
//! without a container runtime: each workload runs in a mount namespace of its own where the
//! agent's files are bind-mounted where NRI mounts them in a container
//! (`ledger::provisioned`): the ledger read-write, the agent's header read-only. The hook must
//! take its limits from that header only, whatever the process's environment or the ledger
//! file's own header says; the same workload outside such a namespace follows its
//! environment (the negative control).
//!
//! Build first: `cargo xtask fake-driver && cargo build -p hook` (or `cargo xtask test`).
use std::path::Path;

use anyhow::{ensure, Context, Result};
use e2e::{FakeNode, TempDir, Workload, GIB, MIB};
use ledger::{
    layout::{Header, CONTAINER_CHUNK, CONTAINER_RECORDS, CONTAINER_SLOTS, CREATOR_AGENT},
    provisioned, DeviceConfig, Geometry, Ledger,
};

const QUOTA: u64 = GIB;
const CTX: u64 = 64 * MIB;

/// The agent's part, as `vramguard run --nri` does it: a ledger with `QUOTA` on one device,
/// and its header in a file of its own.
fn provision(dir: &TempDir) -> Result<(std::path::PathBuf, std::path::PathBuf, Header)> {
    let ledger = dir.path().join("ledger");
    let geometry = Geometry {
        slots: CONTAINER_SLOTS,
        records: CONTAINER_RECORDS,
        devices: vec![DeviceConfig { limit: QUOTA, chunk: CONTAINER_CHUNK, context_reserve: CTX, ..Default::default() }],
    };
    let header = *Ledger::create(&ledger, &geometry, CREATOR_AGENT)?.header();
    let limits = dir.path().join("limits");
    std::fs::write(&limits, ledger::file::header_bytes(&header))?;
    Ok((ledger, limits, header))
}

/// `workload` in a mount namespace with `ledger` and `limits` mounted as in a provisioned
/// container (a private tmpfs on /run, so the host's /run is untouched).
fn inside(workload: Workload, ledger: &Path, limits: &Path) -> Workload {
    let script = format!(
        "set -e; mount -t tmpfs tmpfs /run; mkdir -p {dir}; touch {ledger_at} {limits_at}; \
         mount --bind \"$1\" {ledger_at}; mount --bind \"$2\" {limits_at}; mount -o remount,bind,ro {limits_at}; \
         shift 2; exec \"$@\"",
        dir = Path::new(provisioned::LEDGER).parent().map(|p| p.display().to_string()).unwrap_or_default(),
        ledger_at = provisioned::LEDGER,
        limits_at = provisioned::LIMITS,
    );
    workload.wrapped(
        "unshare",
        ["--mount".into(), "--propagation".into(), "private".into(), "--".into(), "sh".into(), "-c".into(), script, "sh".into()]
            .into_iter()
            .chain([ledger.display().to_string(), limits.display().to_string()]),
    )
}

/// A workload that asks the environment for 64 GiB in a ledger of its own, fail-open.
fn lying(node: &FakeNode, own_ledger: &Path) -> Result<Workload> {
    Ok(node
        .hooked(own_ledger, 64 * GIB)?
        .env("VRAMGUARD_FAIL_OPEN", "1")
        .steps(["ctx 0", "alloc a 512m", "expect-oom alloc b 512m", "alloc c 256m", "meminfo"]))
}

fn node(tag: &str) -> FakeNode {
    FakeNode::new(tag).with_env("FAKECUDA_DEVICE_BYTES", "8g").with_env("FAKECUDA_CONTEXT_BYTES", "64m")
}

#[test]
fn the_agents_header_holds_whatever_the_environment_says() -> Result<()> {
    let node = node("prov-env");
    let dir = TempDir::new("prov-env")?;
    let (ledger, limits, _) = provision(&dir)?;
    let own = dir.path().join("own.ledger");
    let done = inside(lying(&node, &own)?, &ledger, &limits).run()?.success()?;
    // 64 MiB context + 512 MiB fit in 1 GiB, 512 MiB more does not, 256 MiB more does.
    ensure!(done.stdout.iter().any(|l| l == "oom b"), "b refused: {:?}", done.stdout);
    let meminfo = done.stdout.iter().find(|l| l.starts_with("meminfo")).context("meminfo")?;
    ensure!(meminfo.contains(&format!("total={QUOTA}")), "cuMemGetInfo shows the agent's quota: {meminfo}");
    ensure!(!own.exists(), "the ledger the environment named is never created");
    let usage = Ledger::open(&ledger)?.device_usage()?;
    ensure!(usage[0].rejections == 1, "the provisioned ledger counted the refusal: {usage:?}");
    node.cleanup();
    Ok(())
}

#[test]
fn without_the_agents_files_the_environment_rules_negative_control() -> Result<()> {
    let node = node("prov-control");
    let dir = TempDir::new("prov-control")?;
    let own = dir.path().join("own.ledger");
    let done = lying(&node, &own)?.run();
    // expect-oom fails the run: b was admitted under the environment's 64 GiB.
    let done = done?;
    ensure!(!done.status.success() && !done.stdout.iter().any(|l| l == "oom b"), "b admitted: {:?}", done.stdout);
    ensure!(own.exists(), "the environment's ledger is used");
    node.cleanup();
    Ok(())
}

#[test]
fn a_rewritten_ledger_header_changes_nothing() -> Result<()> {
    use std::os::unix::fs::FileExt;
    let node = node("prov-rewrite");
    let dir = TempDir::new("prov-rewrite")?;
    let (ledger, limits, header) = provision(&dir)?;
    // What a tenant can do to the file it can write: its header now says 64 GiB.
    let mut lifted = header;
    lifted.devices[0].limit = 64 * GIB;
    lifted.checksum = ledger::layout::fnv1a(ledger::layout::checksummed_bytes(&lifted));
    std::fs::OpenOptions::new().write(true).open(&ledger)?.write_all_at(ledger::file::header_bytes(&lifted), 0)?;
    let own = dir.path().join("own.ledger");
    let done = inside(lying(&node, &own)?, &ledger, &limits).run()?.success()?;
    ensure!(done.stdout.iter().any(|l| l == "oom b"), "still held to 1 GiB: {:?}", done.stdout);
    node.cleanup();
    Ok(())
}

#[test]
fn a_broken_limits_file_refuses_even_fail_open() -> Result<()> {
    let node = node("prov-broken");
    let dir = TempDir::new("prov-broken")?;
    let (ledger, limits, _) = provision(&dir)?;
    std::fs::write(&limits, b"64g")?;
    let own = dir.path().join("own.ledger");
    let workload = node.hooked(&own, 64 * GIB)?.env("VRAMGUARD_FAIL_OPEN", "1").steps(["expect-oom ctx 0"]);
    let done = inside(workload, &ledger, &limits).run()?.success()?;
    ensure!(done.stdout.iter().any(|l| l == "oom ctx"), "refused: {:?}", done.stdout);
    ensure!(
        done.stderr.contains("not a ledger header written by the agent")
            && done.stderr.contains("refusing GPU allocations (this container's quota is provisioned")
            && !done.stderr.contains("WITHOUT"),
        "one clear line: {}",
        done.stderr
    );
    node.cleanup();
    Ok(())
}

#[test]
fn a_gpu_the_agent_did_not_provision_is_refused_even_fail_open() -> Result<()> {
    // The agent's header has one device; this process sees two.
    let node = node("prov-missing").with_env("FAKECUDA_DEVICE_COUNT", "2");
    let dir = TempDir::new("prov-missing")?;
    let (ledger, limits, _) = provision(&dir)?;
    let own = dir.path().join("own.ledger");
    let workload = node.hooked(&own, 64 * GIB)?.env("VRAMGUARD_FAIL_OPEN", "1").steps(["ctx 0", "alloc a 512m", "expect-oom ctx 1"]);
    let done = inside(workload, &ledger, &limits).run()?.success()?;
    ensure!(done.stdout.iter().any(|l| l == "oom ctx"), "GPU 1 refused: {:?}", done.stdout);
    ensure!(
        done.stderr.contains("GPU 1")
            && done.stderr.contains("refusing GPU allocations there (this container's quota is provisioned")
            && !done.stderr.contains("WITHOUT"),
        "one clear line: {}",
        done.stderr
    );
    node.cleanup();
    Ok(())
}
