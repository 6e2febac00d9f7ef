//! A preload that breaks nothing (issue 11, item 2): with `libvramguard.so` preloaded, a
//! program that is not about CUDA sees exactly what it sees without it, alone or beside
//! another preloaded library that wraps a function through `dlsym(RTLD_NEXT)`
//! (`libinterposer.so`, in either order), no symbol lookup loads libcuda, and a child forked
//! while other threads set the hook up or allocate does not hang.
//!
//! `dlvsym` likewise: a preloaded library wrapping a function that has two versions reaches each
//! version through `dlvsym(RTLD_NEXT, ...)` beside the hook, and every `dlvsym` answers what
//! it answers without the hook.
//!
//! The programs are `preload-probe` and `libinterposer.so` (tests/interposer), and the C kit in
//! tests/interposer/versioned, which the dlvsym test compiles with the system's `cc` (gcc is on
//! every machine of this project: CI's is the developers' kind).
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
use e2e::{fake_driver_dir, hook_lib, target_dir, FakeNode, TempDir};

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

// ---- dlvsym ------------------------------------------------------------------------------------

/// The C kit of tests/interposer/versioned, compiled into `dir`: libvgbase.so (two versions of
/// `vg_versioned` and of `cuMemAlloc_v2`, an unversioned `vg_plain`), libvgnover.so (no
/// version tables; `cuMemFree_v2`), libvgwrap.so (the preloadable wrapper) and vgprobe (linked
/// against the first two).
fn build_versioned_kit(dir: &std::path::Path) -> Result<()> {
    let sources = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../interposer/versioned");
    let src = |name: &str| sources.join(name).into_os_string();
    let out = |name: &str| dir.join(name).into_os_string();
    let mut map = OsString::from("-Wl,--version-script=");
    map.push(src("base.map"));
    let builds: [Vec<OsString>; 4] = [
        vec!["-shared".into(), "-fPIC".into(), "-Wl,-soname,libvgbase.so".into(), map, "-o".into(), out("libvgbase.so"), src("base.c")],
        vec!["-shared".into(), "-fPIC".into(), "-nostdlib".into(), "-Wl,-soname,libvgnover.so".into(), "-o".into(), out("libvgnover.so"), src("nover.c")],
        vec!["-shared".into(), "-fPIC".into(), "-O0".into(), "-o".into(), out("libvgwrap.so"), src("wrap.c"), "-ldl".into()],
        vec![
            "-O0".into(),
            "-o".into(),
            out("vgprobe"),
            src("probe.c"),
            "-L".into(),
            dir.as_os_str().into(),
            "-Wl,--no-as-needed".into(),
            "-lvgbase".into(),
            "-lvgnover".into(),
            "-Wl,-rpath,$ORIGIN".into(),
            "-ldl".into(),
        ],
    ];
    for args in builds {
        let output = Command::new("cc").args(&args).output().context("running cc (the C compiler: gcc on this project's machines)")?;
        ensure!(output.status.success(), "cc {args:?} failed: {}", String::from_utf8_lossy(&output.stderr));
    }
    // The kit is what it claims: two versions of one name, and an object with no version tables.
    let dynamic = |lib: &str| -> Result<String> {
        let output = Command::new("readelf").args(["--dyn-syms", "--dynamic"]).arg(dir.join(lib)).output().context("readelf")?;
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    };
    let base = dynamic("libvgbase.so")?;
    ensure!(base.contains("vg_versioned@VG_1") && base.contains("vg_versioned@@VG_2") && base.contains("cuMemAlloc_v2@VG_1"), "{base}");
    ensure!(!dynamic("libvgnover.so")?.contains("VERSYM"), "libvgnover.so has version tables");
    Ok(())
}

/// `vgprobe ARGS` with `LD_PRELOAD=preload` and `node`'s settings (as [`probe`]).
fn vgprobe(node: &FakeNode, kit: &std::path::Path, preload: &OsString, args: &[&str]) -> Result<String> {
    let command = probe(node, preload, args)?;
    let mut vgprobe = Command::new(kit.join("vgprobe"));
    vgprobe.args(args);
    for (key, value) in command.get_envs() {
        match value {
            Some(value) => vgprobe.env(key, value),
            None => vgprobe.env_remove(key),
        };
    }
    run(&mut vgprobe)
}

/// The answer of one lookup line (`WHO:WHAT -> ANSWER`).
fn answer<'a>(out: &'a str, what: &str) -> Result<&'a str> {
    let prefix = format!("{what} -> ");
    out.lines().find_map(|l| l.strip_prefix(prefix.as_str())).with_context(|| format!("no `{what}` line in:\n{out}"))
}

#[test]
fn dlvsym_gets_glibcs_answer_beside_the_hook_for_every_handle_and_version() -> Result<()> {
    let node = FakeNode::new("preload-dlvsym");
    let kit = TempDir::new("dlvsym-kit")?;
    build_versioned_kit(kit.path())?;
    let hook = hook_lib()?.into_os_string();
    let wrapper = kit.path().join("libvgwrap.so").into_os_string();
    let join = |a: &OsString, b: &OsString| {
        let mut joined = a.clone();
        joined.push(":");
        joined.push(b);
        joined
    };
    let orders = [
        ("hook alone", OsString::new(), hook.clone()),
        ("hook, then the wrapper", wrapper.clone(), join(&hook, &wrapper)),
        ("the wrapper, then the hook", wrapper.clone(), join(&wrapper, &hook)),
    ];
    // Names the hook exports: glibc's `dlsym(RTLD_NEXT)` finds the hook's own definition where
    // the hook comes after the caller (`dlvsym` never does: it is unversioned in an object with
    // version tables).
    let hook_exports = ["cuMemAlloc_v2", "cuMemFree_v2"];
    for (order, without, with) in &orders {
        for mode in [&[][..], &["cuda"][..]] {
            let label = format!("{order}, {}", if mode.is_empty() { "libcuda not loaded" } else { "libcuda loaded" });
            let baseline = vgprobe(&node, kit.path(), without, mode)?;
            let hooked = vgprobe(&node, kit.path(), with, mode)?;
            let wrapped = !without.is_empty();

            // glibc's rules, as the run without the hook shows them (what the hook must mirror).
            let call = if wrapped { "call vg_versioned=1002" } else { "call vg_versioned=2" };
            ensure!(baseline.contains(call), "{label}: the program's call reaches VG_2 (through the wrapper): {baseline}");
            let who = if wrapped { "wrap" } else { "main" };
            for (what, expected) in [
                ("dlvsym(RTLD_NEXT,vg_versioned,VG_1)", "libvgbase.so:vg_versioned=1"),
                ("dlvsym(RTLD_NEXT,vg_versioned,VG_3)", "-"),
                ("dlvsym(RTLD_NEXT,cuMemAlloc_v2,VG_1)", "libvgbase.so:cu_mem_alloc_1=101"),
                ("dlvsym(RTLD_NEXT,cuMemAlloc_v2,GLIBC_2.2.5)", "-"),
                // An unversioned definition in an object that has version tables: never.
                ("dlvsym(RTLD_NEXT,vg_plain,VG_1)", "-"),
                // An object without version tables: its definition, whatever the version.
                ("dlvsym(RTLD_NEXT,cuMemFree_v2,VG_3)", "libvgnover.so:cuMemFree_v2=201"),
            ] {
                let found = answer(&baseline, &format!("{who}:{what}"))?;
                ensure!(found == expected, "{label}: without the hook, {who}:{what} -> {found}, expected {expected}");
            }
            ensure!(answer(&baseline, &format!("{who}:dlvsym(RTLD_NEXT,vg_versioned,VG_2)"))?.ends_with("=2"), "{label}: {baseline}");
            ensure!(answer(&baseline, "main:dlvsym(RTLD_DEFAULT,cuMemAlloc_v2,VG_1)")? == "libvgbase.so:cu_mem_alloc_1=101", "{label}: {baseline}");

            // With the hook: the same program output, line for line, but for the hook's own
            // exports found by `dlsym(RTLD_NEXT)` from a caller the hook comes after.
            ensure!(hooked.contains(call), "{label}: with the hook: {hooked}");
            let (before, after): (Vec<&str>, Vec<&str>) = (baseline.lines().collect(), hooked.lines().collect());
            ensure!(before.len() == after.len(), "{label}: different lookups:\nwithout the hook:\n{baseline}\nwith it:\n{hooked}");
            for (line, (b, h)) in before.iter().zip(&after).enumerate() {
                if b == h || h.starts_with("main:dlsym(libcuda,") {
                    continue; // the driver's entry point substituted: checked below
                }
                let (what, found) = h.split_once(" -> ").unwrap_or((h, ""));
                let hook_after_caller = what.starts_with("main:") || *order == "the wrapper, then the hook";
                let own_export = hook_exports.iter().any(|name| what.contains(&format!("dlsym(RTLD_NEXT,{name})")) && found == format!("libvramguard.so:{name}"));
                ensure!(
                    hook_after_caller && own_export,
                    "{label}: line {line} differs: without the hook `{b}`, with it `{h}` (only a dlsym(RTLD_NEXT) finding the hook's own export may)"
                );
            }
            let loaded = if mode.is_empty() { "libcuda loaded=0" } else { "libcuda loaded=1" };
            ensure!(hooked.lines().last() == Some(loaded), "{label}: no lookup loaded libcuda (control: the cuda mode loads it): {hooked}");
            if !mode.is_empty() {
                // The control of the substitution: in this very process the hook hands out its
                // wrapper for the driver's entry point through dlsym; dlvsym finds none (the
                // driver's symbols are unversioned in an object with version tables).
                ensure!(answer(&baseline, "main:dlsym(libcuda,cuMemAlloc_v2)")? == "libcuda.so.1:cuMemAlloc_v2", "{label}: {baseline}");
                ensure!(answer(&hooked, "main:dlsym(libcuda,cuMemAlloc_v2)")? == "libvramguard.so:cuMemAlloc_v2", "{label}: {hooked}");
                ensure!(answer(&hooked, "main:dlvsym(libcuda,cuMemAlloc_v2,VG_2)")? == "-", "{label}: {hooked}");
            }
        }
    }
    node.cleanup();
    Ok(())
}
