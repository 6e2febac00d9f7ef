//! The first hooked process of a container: how long it takes from its start to its first
//! allocation, with the ledger in each state the first process can find it in (issue 24,
//! item 5), side by side with no hook, in one run.
//!
//! Each of [`ROUNDS`] rounds runs every one of [`CASES`] once, starting with a different one
//! each round; what a case adds is taken against the same round's run without the hook. A
//! sample is one process of the release `fakecuda-workload` (`ctx 0`, `alloc a 1m`), timed
//! from just before its spawn to the moment its `ok alloc` line arrives on its pipe: exec,
//! the loader (and the preloaded hook), `cuInit`, the context (where the hook sets itself up:
//! opens or creates the ledger, takes a slot) and the first allocation.
//!
//! Every case's process starts in a mount namespace of its own with a private tmpfs on /run
//! (between fork and exec, by system calls: no helper process), so all pay the same; the
//! provisioned case also gets the agent's two files bind-mounted where NRI mounts them
//! ([`ledger::provisioned`]), the limits read-only. The provisioned ledgers are made by the
//! agent's own code before the rounds, one per round: `agent/examples/provision_ledgers.rs`
//! calls `Store::create` with the agent's `Mounter` (each ledger in a tmpfs of its size, every
//! page allocated, the limits file), sized as `--max-processes-per-container` (128) sizes it.
use std::{
    fmt::Write as _,
    ffi::CString,
    fs,
    io::{BufRead as _, BufReader, Write as _},
    os::unix::{ffi::OsStrExt as _, process::CommandExt as _},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Instant,
};

use anyhow::{bail, Context, Result};

use super::{Row, Setup, Spread};
use crate::{cargo, root, run};

/// Rounds of the measurement (`VRAMGUARD_BENCH_ROUNDS` overrides it, for a quick look).
const ROUNDS: usize = 41;

/// The quota, the same for the hook's own ledger (`CUDA_DEVICE_MEMORY_LIMIT`, as
/// [`Setup::command`] sets it) and the agent's.
const QUOTA: u64 = 32 << 30;

/// The agent's default `--max-processes-per-container`.
const PROCESSES: u32 = 128;

const STEPS: [&str; 2] = ["ctx 0", "alloc a 1m"];

/// The heading of this section of the report.
pub const HEADING: &str = "## The first hooked process of a container";

#[derive(Clone, Copy, PartialEq)]
enum Case {
    Bare,
    Provisioned,
    Own,
    Warm,
}

/// The cases, each round running every one; the hooked ones get their rows, named here.
const CASES: [(Case, &str); 4] = [
    (Case::Bare, "no hook"),
    (Case::Provisioned, "(a) the ledger the agent provisioned before the container started"),
    (Case::Own, "(b) the hook creates its own ledger (cold: the container's first process, no ledger mounted)"),
    (Case::Warm, "(c) warm: the ledger exists, another process of the container holds a slot"),
];

/// Measures; returns the section of the report.
pub fn cold_start(setup: &Setup) -> Result<String> {
    run(cargo().args(["build", "-p", "agent", "--example", "provision_ledgers"]))?;
    let provisioner = root().join("target/debug/examples/provision_ledgers");
    let rounds = std::env::var("VRAMGUARD_BENCH_ROUNDS").ok().and_then(|n| n.parse().ok()).unwrap_or(ROUNDS);
    let node = format!("bench-cold-{}", std::process::id());
    let scratch = setup.scratch.join("cold");
    fs::create_dir_all(&scratch)?;
    let result = measure(setup, &provisioner, &node, &scratch, rounds);
    setup.cleanup(&node);
    let _ = fs::remove_dir_all(&scratch);
    result
}

fn measure(setup: &Setup, provisioner: &Path, node: &str, scratch: &Path, rounds: usize) -> Result<String> {
    let agent = Provisioner::start(provisioner, scratch, rounds)?;
    // The fake driver's node made, so no case pays for it.
    sample(setup, node, None)?;
    // The warm case's ledger, and its first process, holding a slot throughout.
    let warm_ledger = scratch.join("warm.ledger");
    let mut holder = setup
        .command(node, Some(&warm_ledger), &["ctx 0", "alloc held 1m", "checkpoint hold"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("cannot start the warm ledger's holder")?;
    let held = wait_for(&mut holder, "checkpoint hold");
    let result = held.and_then(|()| {
        let mut added: Vec<Vec<f64>> = vec![Vec::new(); CASES.len()];
        let mut bare_ns = Vec::new();
        let mut own_bytes = 0;
        for round in 0..rounds {
            let mut took = [0.0; CASES.len()];
            for turn in 0..CASES.len() {
                let index = (round + turn) % CASES.len();
                let (case, _) = CASES[index];
                let own = scratch.join(format!("own-{round}.ledger"));
                let (ledger, binds) = match case {
                    Case::Bare => (None, None),
                    Case::Provisioned => (Some(agent.ledgers[round].0.as_path()), Some(&agent.ledgers[round])),
                    Case::Own => (Some(own.as_path()), None),
                    Case::Warm => (Some(warm_ledger.as_path()), None),
                };
                took[index] = sample(setup, node, ledger.map(|l| (l, binds)))?;
                if case == Case::Own {
                    own_bytes = fs::metadata(&own).with_context(|| format!("the hook made no ledger at {}", own.display()))?.len();
                    let _ = fs::remove_file(&own);
                    let _ = fs::remove_file(scratch.join(format!(".own-{round}.ledger.lock")));
                }
            }
            bare_ns.push(took[0]);
            for (index, ns) in took.iter().enumerate().skip(1) {
                added[index].push(ns - took[0]);
            }
        }
        Ok(section(&added, &bare_ns, own_bytes, agent.bytes, rounds))
    });
    if let Some(mut stdin) = holder.stdin.take() {
        let _ = stdin.write_all(b"\n");
    }
    let _ = holder.wait();
    agent.stop()?;
    result
}

/// The agent's provisioned ledgers, one per round, alive while the provisioner runs.
struct Provisioner {
    child: Child,
    /// (ledger, limits) on the host.
    ledgers: Vec<(PathBuf, PathBuf)>,
    /// The size of one ledger file.
    bytes: u64,
}

impl Provisioner {
    fn start(binary: &Path, scratch: &Path, rounds: usize) -> Result<Provisioner> {
        let (state, ledgers) = (scratch.join("state"), scratch.join("ledgers"));
        fs::create_dir_all(&ledgers)?;
        let mut child = Command::new(binary)
            .arg(&state)
            .arg(&ledgers)
            .arg(QUOTA.to_string())
            .arg(PROCESSES.to_string())
            .args((0..rounds).map(|round| format!("bench-cold-{round}")))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot run {}", binary.display()))?;
        let mut made = Vec::new();
        let mut bytes = 0;
        let stdout = child.stdout.take().context("the provisioner's stdout")?;
        for line in BufReader::new(stdout).lines() {
            let line = line?;
            if line == "ready" {
                return Ok(Provisioner { child, ledgers: made, bytes });
            }
            let value = |key: &str| line.split_whitespace().find_map(|f| f.strip_prefix(key)).map(str::to_string);
            let (Some(ledger), Some(limits), Some(size)) = (value("ledger="), value("limits="), value("bytes=")) else {
                bail!("the provisioner said {line:?}");
            };
            bytes = size.parse()?;
            made.push((PathBuf::from(ledger), PathBuf::from(limits)));
        }
        let _ = child.wait();
        bail!("the provisioner ended before it was ready (its ledgers: {})", made.len())
    }

    /// Closes its input: it removes what it made, as the agent removes a container.
    fn stop(mut self) -> Result<()> {
        drop(self.child.stdin.take());
        let status = self.child.wait()?;
        if !status.success() {
            bail!("the provisioner failed to remove its containers: {status}");
        }
        Ok(())
    }
}

/// The time from the spawn of one workload to its first allocation, in ns.
fn sample(setup: &Setup, node: &str, ledger: Option<(&Path, Option<&(PathBuf, PathBuf)>)>) -> Result<f64> {
    let mut command = setup.command(node, ledger.map(|(l, _)| l), &STEPS);
    in_namespace(&mut command, ledger.and_then(|(_, binds)| binds))?;
    let start = Instant::now();
    let mut child = command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().context("cannot start the workload")?;
    let took = wait_for(&mut child, "ok alloc a").map(|()| start.elapsed().as_nanos() as f64);
    let output = child.wait_with_output()?;
    if !output.status.success() {
        bail!("the workload failed: {}", String::from_utf8_lossy(&output.stderr));
    }
    took
}

/// Reads `child`'s stdout until a line starts with `prefix`.
fn wait_for(child: &mut Child, prefix: &str) -> Result<()> {
    let stdout = child.stdout.as_mut().context("the workload's stdout")?;
    let mut reader = BufReader::new(stdout);
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            bail!("the workload ended without printing `{prefix}`");
        }
        if line.starts_with(prefix) {
            return Ok(());
        }
    }
}

/// Starts `command` in a mount namespace of its own with a private tmpfs on /run and, given
/// `binds` (ledger, limits on the host), those files bind-mounted at [`ledger::provisioned`]'s
/// paths, the limits read-only: what NRI gives a provisioned container.
fn in_namespace(command: &mut Command, binds: Option<&(PathBuf, PathBuf)>) -> Result<()> {
    let c = |path: &Path| CString::new(path.as_os_str().as_bytes()).context("a path with a NUL byte");
    let binds = match binds {
        Some((ledger, limits)) => Some((c(ledger)?, c(limits)?)),
        None => None,
    };
    let (ledger_at, limits_at) = (c(Path::new(ledger::provisioned::LEDGER))?, c(Path::new(ledger::provisioned::LIMITS))?);
    let dir = c(Path::new(ledger::provisioned::LEDGER).parent().context("the ledger's directory")?)?;
    let check = |rc: libc::c_int| if rc == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) };
    // SAFETY: the closure makes only async-signal-safe system calls on strings made before the
    // fork; it allocates nothing.
    unsafe {
        command.pre_exec(move || {
            let null = std::ptr::null();
            check(libc::unshare(libc::CLONE_NEWNS))?;
            check(libc::mount(c"none".as_ptr(), c"/".as_ptr(), null, libc::MS_REC | libc::MS_PRIVATE, null.cast()))?;
            check(libc::mount(c"tmpfs".as_ptr(), c"/run".as_ptr(), c"tmpfs".as_ptr(), 0, null.cast()))?;
            check(libc::mkdir(dir.as_ptr(), 0o755))?;
            if let Some((ledger, limits)) = &binds {
                for (from, to) in [(ledger, &ledger_at), (limits, &limits_at)] {
                    let fd = libc::open(to.as_ptr(), libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC, 0o644);
                    if fd < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    libc::close(fd);
                    check(libc::mount(from.as_ptr(), to.as_ptr(), null, libc::MS_BIND, null.cast()))?;
                }
                let flags = libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY;
                check(libc::mount(null, limits_at.as_ptr(), null, flags, null.cast()))?;
            }
            Ok(())
        });
    }
    Ok(())
}

/// The section: its rows, how they were measured, and where vramguard stands against
/// HAMi-core's recorded figures.
fn section(added: &[Vec<f64>], bare_ns: &[f64], own_bytes: u64, agent_bytes: u64, rounds: usize) -> String {
    let bare = Spread::of(bare_ns);
    let mut text = format!(
        "{HEADING}\n\nWritten by `cargo xtask bench` (this section alone: `cargo xtask bench --cold-start-only`). \
         Machine: {}; date: {}.\n\n| name | figure | unit | baseline | ratio |\n|---|---|---|---|---|\n",
        super::machine(),
        super::today()
    );
    let to_ms = |samples: &[f64]| samples.iter().map(|ns| ns / 1e6).collect::<Vec<_>>();
    for (index, (_, name)) in CASES.iter().enumerate().skip(1) {
        let spread = Spread::of(&to_ms(&added[index]));
        let mut row = Row::added(
            format!("first hooked process of a container, spawn to its first allocation: {name}"),
            spread.median,
            "ms added",
            bare.median / 1e6,
            "ms, no hook",
        )
        .with_spread(spread);
        row.decimals = 2;
        let _ = writeln!(text, "{}", row.line());
    }
    let _ = write!(
        text,
        "\nHow: {rounds} rounds, each running the four cases once (the first a different one each round); \
         a figure is the median over the rounds of what the case took more than the same round's \
         process without the hook, with its interquartile range (nearest rank); the baseline is \
         the median process without the hook (IQR {:.2}-{:.2} ms). A sample is one process of the \
         release `fakecuda-workload` (`ctx 0`, `alloc a 1m`) on the fake driver (64 GiB device, \
         64 MiB contexts), from just before its spawn to its `ok alloc` line on a pipe. Every \
         process starts in a mount namespace of its own with a private tmpfs on /run (system calls \
         between fork and exec), so every case pays the same for it. The quota is 32 GiB on one \
         GPU in every case. (a): a ledger made by the agent's own code path before the rounds \
         (`agent/examples/provision_ledgers.rs`: `Store::create` with the agent's `Mounter`, as \
         NRI CreateContainer makes it: a tmpfs of the ledger's size, every page allocated, the \
         limits file), sized by `--max-processes-per-container` 128: {} KiB; a fresh one for each \
         round, bind-mounted with its limits at `/run/vramguard/` as NRI mounts them; the hook \
         maps it with the agent's header and takes the first slot. (b): the hook finds no ledger \
         mounted and creates its own at `VRAMGUARD_LEDGER` in the benchmark's scratch directory \
         under `/tmp` (the node's disk, as a container's `/tmp` is), a new path each round: {} KiB \
         ({} slots, {} records). (c): the ledger the hook made, with its first process alive and \
         holding a slot and an allocation throughout.\n",
        bare.q1 / 1e6,
        bare.q3 / 1e6,
        agent_bytes / 1024,
        own_bytes / 1024,
        ledger::layout::CONTAINER_SLOTS,
        ledger::layout::CONTAINER_RECORDS,
    );
    text.push_str(HAMI_CORE);
    let median = |index: usize| Spread::of(&to_ms(&added[index])).median;
    let (provisioned, own, warm) = (median(1), median(2), median(3));
    let _ = writeln!(
        text,
        "\nWhere this run stands against those figures: the first process of a provisioned container \
         (a) adds {provisioned:.2} ms, against HAMi-core's cold +{HAMI_COLD_MS} ms ({:.1}x) and warm \
         +{HAMI_WARM_MS} ms; a hook that creates its own ledger (b) adds {own:.2} ms ({:.1}x HAMi-core's \
         cold figure); a warm start (c) {warm:.2} ms ({:.1}x HAMi-core's warm figure).",
        provisioned / HAMI_COLD_MS,
        own / HAMI_COLD_MS,
        warm / HAMI_WARM_MS,
    );
    text
}

/// HAMi-core's recorded start-up to the first allocation, cold and warm (ms added).
const HAMI_COLD_MS: f64 = 1.4;
const HAMI_WARM_MS: f64 = 0.72;

/// HAMi-core's figures as docs/design.md records them ("Measured side by side"; not
/// measured by this benchmark: its sources are not on the machines this runs on).
const HAMI_CORE: &str = "\nHAMi-core is not measured here: its sources are not on this machine. \
    Recorded on 2026-11-26 in docs/design.md (\"Prior art\", \"Measured side by side\": \
    HAMi-core `8f3a89c` as its build script ships it, Debug -O0, against vramguard's hook on the same fake \
    driver, in one run): start-up to the first allocation, warm +0.72 ms (HAMi-core) against \
    +0.36 ms (vramguard); cold, the first process creating the shared file, +1.4 ms (HAMi-core) \
    against +7.0 ms (vramguard, the hook's fixed 4.7 MiB ledger then). Those figures come from \
    another run and another method, so only their order of magnitude compares with the rows above.\n";
