//! Say it, never silently pass (issue 11, item 3): a setting the hook cannot use and a GPU its
//! ledger does not know each get one clear line on stderr and a refusal, unless
//! `VRAMGUARD_FAIL_OPEN=1`, which then really runs without limits, said once too; and the
//! processes of one container under different uids share its ledger (created 0666 whatever
//! the creator's umask).
//!
//! Build first: `cargo build -p hook -p fakecuda -p workload` (or `cargo xtask test`).
use std::os::unix::fs::PermissionsExt;

use anyhow::{ensure, Context, Result};
use e2e::{field, FakeNode, TempDir, GIB, MIB};
use ledger::{Kind, Ledger};

fn node(tag: &str) -> FakeNode {
    FakeNode::new(tag).with_env("FAKECUDA_DEVICE_BYTES", "4g").with_env("FAKECUDA_CONTEXT_BYTES", "64m")
}

#[test]
fn an_unparsable_limit_refuses_or_with_fail_open_runs_unlimited_said_once() -> Result<()> {
    let node = node("say-limit");
    let ledger = node.ledger_path();
    let bad = "CUDA_DEVICE_MEMORY_LIMIT=\"lots\" is not a size";

    // Refused, contexts included, with one line naming the variable and the way out.
    let out = node
        .hooked(&ledger, GIB)?
        .env("CUDA_DEVICE_MEMORY_LIMIT", "lots")
        .steps(["expect-oom ctx 0", "expect-oom alloc a 2m"])
        .run()?
        .success()?;
    ensure!(out.lines("oom ").count() == 2, "both refused: {:?}", out.stdout);
    ensure!(out.stderr.matches(bad).count() == 1 && out.stderr.lines().count() == 1, "one line: {:?}", out.stderr);
    ensure!(out.stderr.contains("refusing GPU allocations") && out.stderr.contains("VRAMGUARD_FAIL_OPEN=1"), "{:?}", out.stderr);

    // Fail-open really runs without limits (2 GiB; the environment meant some quota), said once.
    let out = node
        .hooked(&ledger, GIB)?
        .env("CUDA_DEVICE_MEMORY_LIMIT", "lots")
        .env("VRAMGUARD_FAIL_OPEN", "1")
        .steps(["ctx 0", "alloc a 2g", "alloc b 1g", "meminfo"])
        .run()?
        .success()?;
    ensure!(out.line("ok alloc b ").is_ok(), "3 GiB allocated: {:?}", out.stdout);
    ensure!(field(out.line("meminfo ")?, "total")? == 4 * GIB, "the driver's own meminfo: {:?}", out.stdout);
    ensure!(out.stderr.lines().count() == 1, "one line: {:?}", out.stderr);
    ensure!(out.stderr.contains(bad) && out.stderr.contains("WITHOUT GPU memory limits"), "{:?}", out.stderr);
    ensure!(!ledger.exists(), "no ledger made from settings the hook could not read");

    // A fail-open setting that is itself unusable opens nothing.
    let out = node
        .hooked(&ledger, GIB)?
        .env("CUDA_DEVICE_MEMORY_LIMIT", "lots")
        .env("VRAMGUARD_FAIL_OPEN", "yes")
        .steps(["expect-oom ctx 0"])
        .run()?
        .success()?;
    ensure!(out.line("oom ctx").is_ok() && !out.stderr.contains("WITHOUT"), "{:?} {:?}", out.stdout, out.stderr);
    node.cleanup();
    Ok(())
}

#[test]
fn a_gpu_missing_from_the_ledger_is_refused_or_with_fail_open_said() -> Result<()> {
    let node = node("say-missing").with_env("FAKECUDA_DEVICE_COUNT", "2");
    let ledger = node.ledger_path();
    // The container's first process sees one GPU: the ledger knows that one only.
    node.hooked(&ledger, GIB)?.env("FAKECUDA_DEVICE_COUNT", "1").steps(["ctx 0", "alloc a 2m"]).run()?.success()?;
    ensure!(Ledger::open(&ledger)?.header().device_count == 1, "a one-device ledger");

    // A process that sees two: GPU 0 enforced as before, GPU 1 refused, said once.
    let out = node
        .hooked(&ledger, GIB)?
        .steps(["ctx 0", "alloc a 512m", "expect-oom alloc b 1g", "expect-oom ctx 1", "devstat 1"])
        .run()?
        .success()?;
    ensure!(out.lines("oom ").count() == 2, "{:?}", out.stdout);
    ensure!(field(out.line("devstat ")?, "used")? == 0, "nothing reached GPU 1: {:?}", out.stdout);
    let missing = "GPU 1 (GPU-";
    ensure!(out.stderr.lines().filter(|l| l.contains(missing)).count() == 1, "one line: {:?}", out.stderr);
    ensure!(
        out.stderr.contains(&format!("is not in the ledger {} (it has 1 device(s)); refusing GPU allocations there", ledger.display()))
            && out.stderr.contains("VRAMGUARD_FAIL_OPEN=1"),
        "{:?}",
        out.stderr
    );

    // Fail-open: GPU 1 runs without limits, said; GPU 0 is still held to its quota.
    let out = node
        .hooked(&ledger, GIB)?
        .env("VRAMGUARD_FAIL_OPEN", "1")
        .steps(["ctx 1", "alloc big 2g", "ctx 0", "expect-oom alloc b 2g"])
        .run()?
        .success()?;
    ensure!(out.line("ok alloc big ").is_ok() && out.line("oom b").is_ok(), "{:?}", out.stdout);
    ensure!(
        out.stderr.lines().count() == 2
            && out.stderr.contains("is not in the ledger")
            && out.stderr.contains("VRAMGUARD_FAIL_OPEN=1: running WITHOUT GPU memory limits there"),
        "the missing GPU said once (and the refusal on GPU 0): {:?}",
        out.stderr
    );
    node.cleanup();
    Ok(())
}

#[test]
fn processes_of_different_uids_share_one_ledger() -> Result<()> {
    let node = node("say-uids");
    let dir = TempDir::new("say-uids")?;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o1777))?;
    let ledger = dir.path().join("ledger");
    // Each process as its own uid; the first creates the ledger with a umask of 077.
    let as_user = |uid: u32| {
        let ids = [format!("--reuid={uid}"), format!("--regid={uid}")];
        let script = "umask 077; exec \"$0\" \"$@\"";
        ["--clear-groups".to_string(), ids[0].clone(), ids[1].clone(), "sh".into(), "-c".into(), script.into()]
    };
    let first = e2e::holding(node.hooked(&ledger, GIB)?.wrapped("setpriv", as_user(4242)), &["ctx 0", "alloc a 128m"])?;
    let mode = std::fs::metadata(&ledger).context("the first process made the ledger")?.permissions().mode() & 0o777;
    ensure!(mode == 0o666, "the ledger is 0{mode:o}, not 0666");
    let lock = dir.path().join(".ledger.lock");
    let lock_mode = std::fs::metadata(&lock)?.permissions().mode() & 0o777;
    ensure!(lock_mode == 0o666, "its lock file is 0{lock_mode:o}, not 0666");

    // The second uid is admitted, and counted in the same ledger: 64 MiB context + 128 MiB
    // each, so 768 MiB more does not fit under 1 GiB.
    let out = node
        .hooked(&ledger, GIB)?
        .wrapped("setpriv", as_user(4343))
        .steps(["ctx 0", "alloc b 128m", "expect-oom alloc c 768m"])
        .run()?
        .success()?;
    ensure!(out.line("ok alloc b ").is_ok() && out.line("oom c").is_ok(), "{:?} {:?}", out.stdout, out.stderr);
    let slots = Ledger::open(&ledger)?.slots()?;
    ensure!(slots.len() == 1, "the second process's slot is gone, the first's is live: {slots:?}");
    ensure!(slots[0].slot.devices[0].bytes[Kind::Data as usize] == 128 * MIB, "{slots:?}");
    first.kill()?;
    node.cleanup();
    Ok(())
}
