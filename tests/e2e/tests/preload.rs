//! A preload that breaks nothing (issue 11, item 2): with `libvramguard.so` preloaded, a
//! program that is not about CUDA sees exactly what it sees without it, alone or beside
//! another preloaded library that wraps a function through `dlsym(RTLD_NEXT)`
//! (`libinterposer.so`, in either order), no symbol lookup loads libcuda, and a child forked
//! while other threads set the hook up or allocate does not hang.
//!
//! The programs are `preload-probe` and `libinterposer.so` (tests/interposer).
//! Build first: `cargo build -p hook -p fakecuda -p interposer` (or `cargo xtask test`).
use std::{
    ffi::OsString,
    io::{BufRead, BufReader, Write},
    os::fd::AsRawFd,
    path::PathBuf,
    process::{Command, Output, Stdio},
    sync::mpsc,
};

use anyhow::{bail, ensure, Context, Result};
use e2e::{fake_driver_dir, hook_lib, target_dir, FakeNode};

fn built(name: &str) -> Result<PathBuf> {
    let path = target_dir()?.join(name);
    ensure!(path.is_file(), "{} is not built: run `cargo build -p interposer` (same profile as the tests) first", path.display());
    Ok(path)
}

/// The preload orders tried: (label, LD_PRELOAD without the hook, with it).
fn orders() -> Result<Vec<(&'static str, OsString, OsString)>> {
    let hook = hook_lib()?.into_os_string();
    let interposer = built("libinterposer.so")?.into_os_string();
    let join = |a: &OsString, b: &OsString| {
        let mut joined = a.clone();
        joined.push(":");
        joined.push(b);
        joined
    };
    Ok(vec![
        ("hook alone", OsString::new(), hook.clone()),
        ("hook, then the interposer", interposer.clone(), join(&hook, &interposer)),
        ("the interposer, then the hook", interposer.clone(), join(&interposer, &hook)),
    ])
}

/// `preload-probe ARGS` with `LD_PRELOAD=preload`, the fake driver on the library path (so a
/// lookup could load it) and `node`'s settings.
fn probe(node: &FakeNode, preload: &OsString, args: &[&str]) -> Result<Command> {
    let mut command = Command::new(built("preload-probe")?);
    command.args(args).env("LD_LIBRARY_PATH", fake_driver_dir()?).env("LD_PRELOAD", preload);
    for (key, value) in node.env() {
        command.env(key, value);
    }
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("VRAMGUARD_") || key.to_string_lossy().starts_with("CUDA_DEVICE_MEMORY_") {
            command.env_remove(key);
        }
    }
    Ok(command)
}

fn run(command: &mut Command) -> Result<String> {
    let Output { status, stdout, stderr } = command.output().with_context(|| format!("running {command:?}"))?;
    let (stdout, stderr) = (String::from_utf8_lossy(&stdout).into_owned(), String::from_utf8_lossy(&stderr).into_owned());
    ensure!(status.success(), "{command:?} failed ({status}): stdout {stdout:?}, stderr {stderr:?}");
    Ok(stdout)
}

#[test]
fn a_getpid_wrapper_through_rtld_next_works_beside_the_hook_in_either_order() -> Result<()> {
    let node = FakeNode::new("preload-getpid");
    for (order, without, with) in orders()? {
        // The interposer alone is the control: it works, and counts.
        for (label, preload) in [("without the hook", &without), ("with the hook", &with)] {
            let out = run(&mut probe(&node, preload, &["getpid"])?)?;
            let interposed = !without.is_empty();
            let expected = format!("getpid same=1 wrapped={}", u8::from(interposed));
            ensure!(out.trim() == expected, "{order}, {label}: {out:?}, expected {expected:?}");
        }
    }
    Ok(())
}

/// The lookup lines of a `lookups` run, less those of names the hook itself exports (found
/// in the hook when it is there, as glibc finds them).
fn foreign_lookups(out: &str) -> Vec<&str> {
    out.lines().filter(|l| !l.contains("cuMemAlloc_v2") && !l.contains("nvmlDeviceGetMemoryInfo")).collect()
}

#[test]
fn lookups_get_glibcs_answers_and_never_load_libcuda() -> Result<()> {
    let node = FakeNode::new("preload-lookups");
    for (order, without, with) in orders()? {
        let baseline = run(&mut probe(&node, &without, &["lookups"])?)?;
        let hooked = run(&mut probe(&node, &with, &["lookups"])?)?;
        ensure!(
            foreign_lookups(&hooked) == foreign_lookups(&baseline),
            "{order}: every lookup of a name the hook does not export is glibc's answer:\nwithout the hook:\n{baseline}\nwith it:\n{hooked}"
        );
        ensure!(hooked.contains("lookup dlsym(RTLD_DEFAULT,cuserid) -> libc.so.6:cuserid"), "{order}: {hooked}");
        ensure!(
            hooked.contains("lookup dlsym(RTLD_DEFAULT,cuMemAlloc_v2) -> libvramguard.so:cuMemAlloc_v2"),
            "{order}: the hook's own export is found as glibc finds it: {hooked}"
        );
        if !without.is_empty() {
            ensure!(
                hooked.contains("lookup interposer:dlsym(RTLD_NEXT,getpid) -> libc.so.6:__getpid"),
                "{order}: RTLD_NEXT from the interposer is relative to the interposer: {hooked}"
            );
        }
        ensure!(hooked.lines().last() == Some("libcuda loaded=0"), "{order}: no lookup (cuserid, cuNoSuchEntryPoint, ...) loaded libcuda: {hooked}");
    }
    // The control: the same check sees libcuda once the program loads it.
    let (_, _, with) = orders()?.remove(0);
    let out = run(&mut probe(&node, &with, &["cuda"])?)?;
    ensure!(out.lines().next() == Some("libcuda loaded=1"), "{out}");
    Ok(())
}

#[test]
fn cuda_lookups_hand_out_the_hooks_wrappers_on_every_route() -> Result<()> {
    let node = FakeNode::new("preload-cuda");
    for (order, without, with) in orders()? {
        let baseline = run(&mut probe(&node, &without, &["cuda"])?)?;
        let hooked = run(&mut probe(&node, &with, &["cuda"])?)?;
        let line = |out: &str, key: &str| out.lines().find(|l| l.starts_with(key)).map(str::to_string).unwrap_or_default();
        ensure!(line(&baseline, "cuda dlsym(libcuda)=") == "cuda dlsym(libcuda)=libcuda.so.1:cuMemAlloc_v2", "{order}: {baseline}");
        ensure!(line(&hooked, "cuda dlsym(libcuda)=") == "cuda dlsym(libcuda)=libvramguard.so:cuMemAlloc_v2", "{order}: {hooked}");
        // dlvsym: glibc's answer (the fake's symbols carry no GLIBC version, so none), never
        // the driver's own entry point.
        let versioned = line(&hooked, "cuda dlvsym(");
        let answer = versioned.rsplit('=').next().unwrap_or_default();
        ensure!(versioned == line(&baseline, "cuda dlvsym(") && !answer.contains("libcuda"), "{order}: {versioned}");
        // RTLD_NEXT from the interposer: glibc finds nothing after it among the start-up
        // objects (libcuda was dlopen'ed), or the hook's export when the hook comes after it.
        let next = line(&hooked, "cuda interposer:dlsym(RTLD_NEXT)=");
        let expected = match order {
            "the interposer, then the hook" => "cuda interposer:dlsym(RTLD_NEXT)=libvramguard.so:cuMemAlloc_v2",
            "hook, then the interposer" => "cuda interposer:dlsym(RTLD_NEXT)=-",
            _ => "",
        };
        ensure!(next == expected, "{order}: {next:?}, expected {expected:?}");
        ensure!(next == line(&baseline, "cuda interposer:dlsym(RTLD_NEXT)=") || next.contains("libvramguard"), "{order}: {baseline}");
    }
    Ok(())
}

/// `preload-probe fork 4 FORKS` under the hook, the ledger's creation lock held by this test so
/// that the set-up of the probe's first thread waits inside the hook's set-up turn while the
/// main thread forks (phase 1), then allocations run while it forks again (phase 2).
fn fork_while_setting_up(node: &FakeNode, preload: &OsString) -> Result<()> {
    const FORKS: u32 = 25;
    let ledger = node.ledger_path();
    let lock_path = ledger.with_file_name(format!(".{}.lock", ledger.file_name().context("name")?.to_string_lossy()));
    let lock = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(&lock_path)?;
    // SAFETY: flock on a descriptor this test owns; released by the LOCK_UN below or on drop.
    ensure!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } == 0, "flock {}", lock_path.display());

    let mut command = probe(node, preload, &["fork", "4", &FORKS.to_string()])?;
    command
        .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
        .env("VRAMGUARD_LEDGER", &ledger)
        .env("PROBE_CHILD_SECS", e2e::timeout().as_secs().to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = command.spawn().context("starting preload-probe fork")?;
    let stdout = child.stdout.take().context("stdout")?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    // Generous: phase 1 waits for each child at most PROBE_CHILD_SECS itself.
    let limit = e2e::timeout() * (FORKS + 2);
    let next = |what: &str| -> Result<String> {
        rx.recv_timeout(limit).with_context(|| format!("no `{what}` line from preload-probe: it hangs"))
    };
    let outcome = (|| -> Result<()> {
        let phase1 = next("phase1")?;
        ensure!(phase1 == format!("phase1 exited={FORKS} hung=0"), "children forked during set-up: {phase1}");
        ensure!(next("checkpoint")? == "checkpoint", "checkpoint");
        // SAFETY: our own descriptor.
        unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_UN) };
        child.stdin.as_mut().context("stdin")?.write_all(b"go\n")?;
        let phase2 = next("phase2")?;
        ensure!(phase2 == format!("phase2 exited={FORKS} hung=0"), "children forked during allocations: {phase2}");
        let allocations = next("allocations")?;
        ensure!(allocations.starts_with("allocations ok=") && !allocations.starts_with("allocations ok=0 "), "{allocations}");
        ensure!(allocations.ends_with(" refused=0"), "1 MiB at a time under 1 GiB is never refused: {allocations}");
        Ok(())
    })();
    if outcome.is_err() {
        let _ = child.kill();
    }
    let output = child.wait_with_output()?;
    outcome.with_context(|| format!("stderr: {}", String::from_utf8_lossy(&output.stderr)))?;
    if !output.status.success() {
        bail!("preload-probe fork failed ({}): {}", output.status, String::from_utf8_lossy(&output.stderr));
    }
    Ok(())
}

#[test]
fn a_child_forked_while_threads_set_up_or_allocate_does_not_hang() -> Result<()> {
    for (order, _, with) in orders()? {
        let node = FakeNode::new("preload-fork");
        fork_while_setting_up(&node, &with).with_context(|| order.to_string())?;
        node.cleanup();
    }
    Ok(())
}
