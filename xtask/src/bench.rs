//! `cargo xtask bench`: what vramguard costs a workload, measured against the fake driver
//! (release builds), written to docs/BENCHMARKS.md with the machine and the date.
//!
//! - eBPF probes: an alloc/free pair side by side with no probes, with the eBPF object's
//!   nop programs on the same attach points (`cuMemAlloc_v2` entry and return,
//!   `cuMemFree_v2` entry: the kernel's own floor) and with vramguard's programs there
//!   (attached by the benchmark, so the configurations can alternate run by run), and with
//!   vramguard's programs and a cgroup limit pushed for the workload's cgroup (as for every
//!   provisioned container), and with vramguard's programs keeping no spare record (what a
//!   pair costs at an address the driver hands out for the first time); the ratio of what ours add to what the floor adds, against the
//!   issue's 1.15, per round (median and interquartile range over [`PROBE_ROUNDS`] rounds).
//!   The pair's address is freed and allocated again, as drivers hand it out, so ours take
//!   over the spare record in place (`common::spare`). Two cases:
//!   1 KiB while another small allocation stays live (the fake's charge does not change, so
//!   the pair is cheap and the probes dominate) and 2 MiB (each call changes the device's
//!   shared counters under the fake's file lock).
//! - The hook: the same pairs with and without `libvramguard.so` preloaded, in one process
//!   and in 8 processes sharing one ledger; and the first CUDA call (which sets the hook up:
//!   opens the ledger, takes a slot) of 64 processes started together.
//! - The first hooked process of a container ([`cold_start`]): its start to its first
//!   allocation with the ledger the agent provisioned, with the hook creating its own, and
//!   warm, against no hook. A section of its own; `--cold-start-only` measures and rewrites
//!   that section alone.
//! - The node agent ([`node_agent`]): its resident memory and idle CPU while it watches 100
//!   ledgers, and how long a killed process's slot stays taken (p50, p99), against the targets
//!   of the issue "The agent"; its reconcile passes, reclaims and `/healthz` answers with and
//!   without hostile tenants (issue 17). A section of its own at the end of the report, with
//!   its machine and date; `--agent-only` measures and rewrites that section alone.
//! - The criterion benchmarks of the ledger and the agent ([`criterion`]), against their
//!   issues' targets.
mod cold_start;
mod criterion;
mod node_agent;

use std::{
    fmt::Write as _,
    fs,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
};

use anyhow::{bail, Context, Result};
use common::names;

use crate::{build_ebpf, cargo, root, run, setup};

/// Repeats of each single-process measurement; the median is reported.
const REPEATS: usize = 7;

/// One line of the report.
struct Row {
    name: String,
    figure: f64,
    unit: &'static str,
    baseline: f64,
    baseline_unit: &'static str,
    ratio: Ratio,
    /// Decimals shown of the figure.
    decimals: usize,
    /// Interquartile range of the samples the figure is the median of, where given.
    spread: Option<(f64, f64)>,
}

/// What a row's ratio is.
enum Ratio {
    /// `figure` is a cost added to `baseline`: (baseline + figure) / baseline, how many times
    /// the bare cost the call takes with vramguard.
    Added,
    /// `baseline` is a target that `figure` must stay under: figure / baseline (below 1: met).
    OfTarget,
    /// No baseline: the figure is reported for reference.
    Reported,
}

impl Row {
    /// A cost added to a bare baseline (ratio [`Ratio::Added`]).
    fn added(name: impl Into<String>, figure: f64, unit: &'static str, baseline: f64, baseline_unit: &'static str) -> Row {
        Row { name: name.into(), figure, unit, baseline, baseline_unit, ratio: Ratio::Added, decimals: 0, spread: None }
    }

    /// A figure against a target (ratio [`Ratio::OfTarget`]), shown with `decimals`.
    fn target(name: impl Into<String>, figure: f64, unit: &'static str, decimals: usize, target: f64, target_unit: &'static str) -> Row {
        Row { name: name.into(), figure, unit, baseline: target, baseline_unit: target_unit, ratio: Ratio::OfTarget, decimals, spread: None }
    }

    /// A figure without a baseline (ratio [`Ratio::Reported`]).
    fn reported(name: impl Into<String>, figure: f64, unit: &'static str, decimals: usize) -> Row {
        Row { name: name.into(), figure, unit, baseline: f64::NAN, baseline_unit: "", ratio: Ratio::Reported, decimals, spread: None }
    }

    /// The same row with the interquartile range of its samples.
    fn with_spread(self, spread: Spread) -> Row {
        Row { figure: spread.median, spread: Some((spread.q1, spread.q3)), ..self }
    }

    /// The figure column: the figure and, where given, its interquartile range.
    fn figure(&self) -> String {
        match self.spread {
            Some((q1, q3)) => format!("{:.*} (IQR {:.*}-{:.*})", self.decimals, self.figure, self.decimals, q1, self.decimals, q3),
            None => format!("{:.*}", self.decimals, self.figure),
        }
    }

    /// The row as a line of the report's table.
    fn line(&self) -> String {
        format!("| {} | {} | {} | {} | {} |", self.name, self.figure(), self.unit, self.baseline(), self.ratio())
    }

    fn ratio(&self) -> String {
        match self.ratio {
            Ratio::Added => format!("{:.2}", (self.baseline + self.figure) / self.baseline),
            Ratio::OfTarget => format!("{:.3} of target", self.figure / self.baseline),
            Ratio::Reported => "-".to_string(),
        }
    }

    fn baseline(&self) -> String {
        match self.ratio {
            Ratio::Reported => "-".to_string(),
            _ if self.baseline.fract() == 0.0 => format!("{:.0} {}", self.baseline, self.baseline_unit),
            // Targets are round figures: shown as written.
            Ratio::OfTarget => format!("{} {}", self.baseline, self.baseline_unit),
            _ => format!("{:.1} {}", self.baseline, self.baseline_unit),
        }
    }
}

const SMALL_PAIR: [&str; 3] = ["ctx 0", "alloc keep 512", "bench 200000 1k"];
const BIG_PAIR: [&str; 2] = ["ctx 0", "bench 50000 2m"];

/// The release builds the benchmark drives.
struct Setup {
    workload: PathBuf,
    lib_dir: PathBuf,
    hook: PathBuf,
    scratch: PathBuf,
    /// The cgroup every workload runs in (a limit can be pushed for it).
    cgroup: e2e::cgroup::TestCgroup,
}

impl Setup {
    /// The release builds, a new scratch directory and the benchmark's cgroup.
    fn release() -> Result<Setup> {
        let release = root().join("target/release");
        let scratch = std::env::temp_dir().join(format!("vramguard-bench-{}", std::process::id()));
        fs::create_dir_all(&scratch)?;
        Ok(Setup {
            workload: release.join("fakecuda-workload"),
            lib_dir: e2e::fake_driver_dir_in(&release)?,
            hook: release.join("libvramguard.so"),
            scratch,
            cgroup: e2e::cgroup::TestCgroup::create("bench")?,
        })
    }

    /// A workload command against the fake driver on node `node`, hooked with `ledger` if given.
    fn command(&self, node: &str, ledger: Option<&Path>, steps: &[&str]) -> Command {
        let mut command = Command::new(&self.workload);
        command
            .env("LD_LIBRARY_PATH", &self.lib_dir)
            .env("FAKECUDA_NODE", node)
            .env("FAKECUDA_DEVICE_BYTES", "64g")
            .env("FAKECUDA_CONTEXT_BYTES", "64m")
            .args(steps)
            .stdin(Stdio::null());
        if let Err(error) = self.cgroup.enter(&mut command) {
            eprintln!("bench: the workload stays in this cgroup: {error:#}");
        }
        if let Some(ledger) = ledger {
            command
                .env("LD_PRELOAD", &self.hook)
                .env("CUDA_DEVICE_MEMORY_LIMIT", "32g")
                .env("VRAMGUARD_CONTEXT_RESERVE", "64m")
                .env("VRAMGUARD_LEDGER", ledger);
        }
        command
    }

    fn cleanup(&self, node: &str) {
        let _ = fs::remove_file(format!("/dev/shm/{node}-dev0"));
        let _ = fs::remove_file(self.scratch.join(format!("{node}.ledger")));
    }
}

pub fn bench(probes_only: bool, agent_only: bool, cold_start_only: bool) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the benchmark attaches eBPF programs: run it as root");
    }
    if agent_only {
        return agent_only_report();
    }
    if cold_start_only {
        return cold_start_only_report();
    }
    setup::setup()?;
    let object = build_ebpf()?;
    run(cargo().args(["build", "--release", "-p", "fakecuda", "-p", "workload", "-p", "hook", "-p", "agent"]))?;
    // The end-to-end kit's binaries (its profile is xtask's own): the agent's `audit` client
    // and the node agent benchmark's workloads.
    run(cargo().args(["build", "-p", "agent", "-p", "fakecuda", "-p", "workload", "-p", "hook"]))?;
    let release = root().join("target/release");
    let setup = Setup::release()?;
    let scratch = setup.scratch.clone();
    let mut rows = Vec::new();
    probes(&setup, &object, &mut rows)?;
    if probes_only {
        let _ = fs::remove_dir_all(&scratch);
        for row in &rows {
            println!("{}", row.line());
        }
        return Ok(());
    }
    hook(&setup, &mut rows)?;
    let cold = cold_start::cold_start(&setup)?;
    let _ = fs::remove_dir_all(&scratch);
    let (mut agent, mut notes) = (Vec::new(), Vec::new());
    node_agent::node_agent(&release.join("vramguard"), &mut agent, &mut notes)?;
    criterion::criterion_rows(&mut rows)?;
    write_report(&rows, &cold, &agent_section(&agent, &notes))
}

/// `--cold-start-only`: the first hooked process of a container alone (release builds of the
/// fake driver, the workload and the hook), its section of docs/BENCHMARKS.md rewritten in
/// place (or put before the node agent's) and the rest of the report kept.
fn cold_start_only_report() -> Result<()> {
    run(cargo().args(["build", "--release", "-p", "fakecuda", "-p", "workload", "-p", "hook"]))?;
    let setup = Setup::release()?;
    let section = cold_start::cold_start(&setup);
    let _ = fs::remove_dir_all(&setup.scratch);
    let section = section?;
    println!("{section}");
    let path = root().join("docs/BENCHMARKS.md");
    let text = fs::read_to_string(&path).with_context(|| format!("cannot read {} (a full `cargo xtask bench` writes it)", path.display()))?;
    fs::write(&path, replace_section(&text, cold_start::HEADING, &section)).with_context(|| format!("cannot write {}", path.display()))?;
    println!("wrote the cold start's section of {}", path.display());
    Ok(())
}

/// `report` with its section under `heading` replaced by `section`, or, without one, with
/// `section` put before the node agent's (or at the end).
fn replace_section(report: &str, heading: &str, section: &str) -> String {
    let section = format!("{}\n\n", section.trim_end());
    let starts: Vec<usize> = report.match_indices("\n## ").map(|(at, _)| at + 1).collect();
    if let Some(&start) = starts.iter().find(|&&at| report[at..].starts_with(heading)) {
        let end = starts.iter().copied().find(|&at| at > start).unwrap_or(report.len());
        return format!("{}{section}{}", &report[..start], &report[end..]).trim_end().to_string() + "\n";
    }
    match starts.iter().find(|&&at| report[at..].starts_with(AGENT_HEADING)) {
        Some(&at) => format!("{}{section}{}", &report[..at], &report[at..]),
        None => format!("{}\n\n{}", report.trim_end(), section.trim_end()) + "\n",
    }
}

/// `--agent-only`: the node agent's measurement alone (the eBPF object as last built, by
/// `cargo xtask build-ebpf` or a full run), its section of docs/BENCHMARKS.md rewritten and
/// the rest of the report kept.
fn agent_only_report() -> Result<()> {
    run(cargo().args(["build", "--release", "-p", "agent"]))?;
    // The end-to-end kit's binaries: the agent's `audit` client, the fake driver, the holders.
    run(cargo().args(["build", "-p", "agent", "-p", "fakecuda", "-p", "workload", "-p", "hook"]))?;
    let (mut rows, mut notes) = (Vec::new(), Vec::new());
    node_agent::node_agent(&root().join("target/release/vramguard"), &mut rows, &mut notes)?;
    for row in &rows {
        println!("{}", row.line());
    }
    let path = root().join("docs/BENCHMARKS.md");
    let text = fs::read_to_string(&path).with_context(|| format!("cannot read {} (a full `cargo xtask bench` writes it)", path.display()))?;
    // In place: the sections after it (written by hand, or by other benchmarks) stay.
    fs::write(&path, replace_section(&text, AGENT_HEADING, &agent_section(&rows, &notes))).with_context(|| format!("cannot write {}", path.display()))?;
    println!("wrote the node agent's section of {}", path.display());
    Ok(())
}

/// The `## ` sections of a report that `cargo xtask bench` does not write (every one but the
/// node agent's and the cold start's), in their order.
fn kept_sections(report: &str) -> Vec<&str> {
    let starts: Vec<usize> = report.match_indices("\n## ").map(|(at, _)| at + 1).collect();
    starts
        .iter()
        .enumerate()
        .map(|(i, &start)| &report[start..starts.get(i + 1).copied().unwrap_or(report.len())])
        .filter(|section| !section.starts_with(AGENT_HEADING) && !section.starts_with(cold_start::HEADING))
        .collect()
}

/// The heading of the node agent's section.
const AGENT_HEADING: &str = "## The node agent";

/// The node agent's section of the report: its rows and how they were measured, with the
/// machine and the date (`--agent-only` rewrites it alone).
fn agent_section(rows: &[Row], notes: &[String]) -> String {
    let mut text = format!(
        "{AGENT_HEADING}\n\nWritten by `cargo xtask bench` (this section alone: `cargo xtask bench --agent-only`). \
         Machine: {}; date: {}.\n\n| name | figure | unit | baseline | ratio |\n|---|---|---|---|---|\n",
        machine(),
        today()
    );
    for row in rows {
        let _ = writeln!(text, "{}", row.line());
    }
    if !notes.is_empty() {
        text.push_str("\nHow the node agent's rows were measured:\n\n");
        for note in notes {
            let _ = writeln!(text, "- {note}");
        }
    }
    text
}

/// The target of issue 11: what vramguard's probes add at most 1.15 times what nop programs
/// on the same attach points add.
const FLOOR_TARGET: f64 = 1.15;

/// Rounds of the probe measurement. Each round runs every one of [`CONFIGURATIONS`] back to
/// back, starting with a different one each round so none always
/// follows another; what a round's probes add is taken against that round's own bare run,
/// so a busy machine's drift between rounds cancels out. `VRAMGUARD_BENCH_ROUNDS` overrides
/// it (a quick look; the report's figures use the default).
const PROBE_ROUNDS: usize = 21;

/// What is attached for one configuration of the probe measurement.
#[derive(Clone, Copy)]
enum Probed {
    /// Nothing: the bare pair.
    Nothing,
    /// The nop programs: the kernel's floor.
    Nop,
    /// vramguard's programs, with a limit pushed for the workload's cgroup or not, keeping
    /// spare records (the agent's default) or none.
    Ours { limit: bool, spares: bool },
}

/// The configurations, each round running every one; those of vramguard's programs get their
/// rows, named here.
const CONFIGURATIONS: [(Probed, &str); 5] = [
    (Probed::Nothing, "no probes"),
    (Probed::Nop, "nop programs"),
    (Probed::Ours { limit: false, spares: true }, "eBPF probes"),
    (Probed::Ours { limit: true, spares: true }, "eBPF probes with a cgroup limit pushed (as for every provisioned container)"),
    (
        Probed::Ours { limit: false, spares: false },
        "eBPF probes keeping no spare record (each pair inserts and deletes its record, as at an address the driver hands out for the first time)",
    ),
];

fn probes(setup: &Setup, object: &Path, rows: &mut Vec<Row>) -> Result<()> {
    let libcuda = setup.lib_dir.join("libcuda.so.1");
    let rounds = std::env::var("VRAMGUARD_BENCH_ROUNDS").ok().and_then(|n| n.parse().ok()).unwrap_or(PROBE_ROUNDS);
    let ours = ["mem_alloc", names::ALLOC_RETURN, "mem_free"];
    let nops = [names::NOP_ENTRY, names::NOP_RETURN, names::NOP_ENTRY];
    let count = CONFIGURATIONS.len();
    for (name, steps, pairs) in [("1 KiB", &SMALL_PAIR[..], 200_000u64), ("2 MiB", &BIG_PAIR[..], 50_000)] {
        // Per configuration: what it adds to the round's bare pair, and that over the floor's.
        let (mut bare, mut added, mut ratios) = (Vec::new(), vec![Vec::new(); count], vec![Vec::new(); count]);
        for round in 0..rounds {
            let mut ns = vec![0.0f64; count];
            for config in (0..count).map(|i| (round + i) % count) {
                ns[config] = match CONFIGURATIONS[config].0 {
                    Probed::Nothing => one_pair(setup, steps)?,
                    Probed::Nop => {
                        let _nop = Attached::programs(object, &libcuda, nops, true)?;
                        one_pair(setup, steps)?
                    }
                    Probed::Ours { limit, spares } => {
                        let mut attached = Attached::programs(object, &libcuda, ours, spares)?;
                        if limit {
                            attached.push_limit(setup.cgroup.id)?;
                        }
                        let ns = one_pair(setup, steps)?;
                        let seen = attached.allocs_seen()?;
                        if seen < pairs {
                            bail!("vramguard's programs saw {seen} allocations of a run of {pairs} pairs: not attached?");
                        }
                        ns
                    }
                };
            }
            let shown: Vec<String> = CONFIGURATIONS.iter().zip(&ns).map(|((_, label), ns)| format!("{label}: {ns:.0} ns")).collect();
            println!("probes, {name} pair, round {round}: {}", shown.join("; "));
            bare.push(ns[0]);
            for config in 1..count {
                added[config].push(ns[config] - ns[0]);
                ratios[config].push((ns[config] - ns[0]) / (ns[1] - ns[0]));
            }
        }
        let base = Spread::of(&bare).median;
        rows.push(
            Row::added(
                format!("eBPF floor: nop programs on the same attach points (alloc entry, alloc return, free entry), alloc+free {name} pair"),
                0.0,
                "ns added per pair",
                base,
                "ns per pair, no probes",
            )
            .with_spread(Spread::of(&added[1])),
        );
        for config in 2..count {
            let label = CONFIGURATIONS[config].1;
            let ratio = Spread::of(&ratios[config]);
            println!(
                "probes, {name} pair: {label}: {:.2}x the floor (IQR {:.2}-{:.2}) over {rounds} rounds",
                ratio.median, ratio.q1, ratio.q3
            );
            rows.push(
                Row::added(format!("{label}, alloc+free {name} pair"), 0.0, "ns added per pair", base, "ns per pair, no probes")
                    .with_spread(Spread::of(&added[config])),
            );
            rows.push(
                Row::target(
                    format!("{label} against the floor, alloc+free {name} pair: added / nop added, per round"),
                    0.0,
                    "x",
                    2,
                    FLOOR_TARGET,
                    "x, target",
                )
                .with_spread(ratio),
            );
        }
        // Where the difference lies: the programs' own run time, as the kernel counts it.
        for (config, (probed, label)) in CONFIGURATIONS.iter().enumerate().skip(1) {
            let (programs, limit, spares) = match *probed {
                Probed::Ours { limit, spares } => (ours, limit, spares),
                _ => (nops, false, true),
            };
            let mut attached = Attached::programs(object, &libcuda, programs, spares)?;
            if limit {
                attached.push_limit(setup.cgroup.id)?;
            }
            let stats = aya::sys::enable_stats(aya::sys::Stats::RunTime).context("cannot turn the kernel's eBPF run-time statistics on")?;
            one_pair(setup, steps)?;
            drop(stats);
            let mut run_ns = 0;
            for (program, ns, runs) in attached.run_time(&programs)? {
                println!("probes, {name} pair, {label}: `{program}` runs {:.0} ns a run ({runs} runs, bpf_stats)", ns as f64 / runs.max(1) as f64);
                run_ns += ns;
            }
            let per_pair = run_ns as f64 / pairs as f64;
            let what = if config == 1 { "eBPF nop programs".to_string() } else { (*label).to_string() };
            rows.push(Row::reported(
                format!("{what}: the programs' own run time (kernel bpf_stats, one run), alloc+free {name} pair"),
                per_pair,
                "ns per pair",
                0,
            ));
        }
    }
    Ok(())
}

/// The median and the quartiles of some samples (nearest rank).
#[derive(Clone, Copy)]
struct Spread {
    q1: f64,
    median: f64,
    q3: f64,
}

impl Spread {
    fn of(samples: &[f64]) -> Spread {
        let mut samples = samples.to_vec();
        samples.sort_by(f64::total_cmp);
        let at = |q: usize| samples.get((samples.len().saturating_sub(1) * q + 2) / 4).copied().unwrap_or(f64::NAN);
        Spread { q1: at(1), median: at(2), q3: at(3) }
    }
}

/// ns per pair of one run of the workload.
fn one_pair(setup: &Setup, steps: &[&str]) -> Result<f64> {
    let node = format!("bench-{}", std::process::id());
    let output = setup.command(&node, None, steps).output().context("cannot run the workload")?;
    setup.cleanup(&node);
    field(&output, "bench ", "ns_per_pair=")
}

/// Programs of the eBPF object on the fake driver's `cuMemAlloc_v2` entry and return and
/// `cuMemFree_v2` entry (in that order), attached as perf events (by symbol here; the agent
/// links them as uprobe_multi links where the kernel has them, whose per-call cost showed no
/// difference measured by hand: docs/BENCHMARKS.md), for as long as this
/// lives. The agent's other work (discovery, ledgers, the exit tracepoint) is not part of a
/// pair's cost. Without `spares`, the object is loaded keeping no spare record (the agent's
/// `--max-spare-records-per-process 0`).
struct Attached {
    ebpf: aya::Ebpf,
}

impl Attached {
    fn programs(object: &Path, libcuda: &Path, programs: [&str; 3], spares: bool) -> Result<Attached> {
        use aya::programs::{uprobe::UProbeScope, UProbe};
        let none: u64 = 0;
        let mut loader = aya::EbpfLoader::new();
        if !spares {
            loader.override_global(names::MAX_SPARES_PER_PROCESS, &none, true);
        }
        let mut ebpf = loader.load_file(object).with_context(|| format!("cannot load {}", object.display()))?;
        for (program, symbol) in programs.into_iter().zip(["cuMemAlloc_v2", "cuMemAlloc_v2", "cuMemFree_v2"]) {
            let probe: &mut UProbe = ebpf
                .program_mut(program)
                .with_context(|| format!("the eBPF object has no program `{program}`"))?
                .try_into()?;
            if probe.fd().is_err() {
                probe.load().with_context(|| format!("the kernel refused `{program}`"))?;
            }
            probe
                .attach(symbol, libcuda, UProbeScope::AllProcesses)
                .with_context(|| format!("attaching `{program}` to {symbol} of {}", libcuda.display()))?;
        }
        Ok(Attached { ebpf })
    }

    /// The run time (ns) and the runs the kernel counted of each of `programs` (each named
    /// once), while its statistics were on.
    fn run_time<'a>(&self, programs: &[&'a str]) -> Result<Vec<(&'a str, u64, u64)>> {
        let mut counted = Vec::new();
        for (i, program) in programs.iter().copied().enumerate() {
            if programs[..i].contains(&program) {
                continue;
            }
            let info = self
                .ebpf
                .program(program)
                .with_context(|| format!("the eBPF object has no program `{program}`"))?
                .info()
                .with_context(|| format!("cannot read the kernel's information on `{program}`"))?;
            counted.push((program, info.run_time().as_nanos() as u64, info.run_count()));
        }
        Ok(counted)
    }

    /// Pushes a limit for cgroup `id` as the agent does for a provisioned container (far above
    /// what the benchmark allocates, audit mode): the entry probe then looks the cgroup's limit
    /// and usage up on every allocation.
    fn push_limit(&mut self, id: u64) -> Result<()> {
        let limits = self.ebpf.map_mut(names::CGROUP_LIMITS).context("the eBPF object has no CGROUP_LIMITS map")?;
        let mut limits = aya::maps::HashMap::<_, u64, common::CgroupLimit>::try_from(limits)?;
        limits.insert(id, common::CgroupLimit { limit: 1 << 50, mode: common::enforce::AUDIT, signal: 0 }, 0)?;
        // The map's first generation, written after the map as the agent does.
        let on = self.ebpf.map_mut(names::LIMITS_ON).context("the eBPF object has no LIMITS_ON map")?;
        aya::maps::Array::<_, u32>::try_from(on)?.set(0, 1, 0)?;
        Ok(())
    }

    /// Allocations the programs charged (vramguard's `STATS`).
    fn allocs_seen(&self) -> Result<u64> {
        let map = self.ebpf.map(names::STATS).context("the eBPF object has no STATS map")?;
        let stats: aya::maps::PerCpuArray<_, u64> = aya::maps::PerCpuArray::try_from(map)?;
        Ok(stats.get(&common::stat::ALLOCS_SEEN, 0)?.iter().sum())
    }
}

fn hook(setup: &Setup, rows: &mut Vec<Row>) -> Result<()> {
    for (name, steps) in [("1 KiB", &SMALL_PAIR[..]), ("2 MiB", &BIG_PAIR[..])] {
        let ledger = setup.scratch.join("single.ledger");
        let bare = median_pair(setup, None, steps)?;
        let hooked = median_pair(setup, Some(&ledger), steps)?;
        println!("hook, {name} pair: {bare:.0} ns bare, {hooked:.0} ns hooked");
        rows.push(Row::added(format!("hook, alloc+free {name} pair, 1 process"), hooked - bare, "ns added per pair", bare, "ns per pair, no hook"));
    }
    let steps = ["ctx 0", "alloc keep 512", "bench 50000 1k"];
    let bare = contended_pair(setup, None, &steps)?;
    let hooked = contended_pair(setup, Some(&setup.scratch.join("contended.ledger")), &steps)?;
    println!("hook, 8 processes: {bare:.0} ns bare, {hooked:.0} ns hooked");
    rows.push(Row::added("hook, alloc+free 1 KiB pair, 8 processes on one ledger", hooked - bare, "ns added per pair (median process)", bare, "ns per pair, no hook"));
    let bare = first_call(setup, None)?;
    let hooked = first_call(setup, Some(&setup.scratch.join("startup.ledger")))?;
    println!("first CUDA call, 64 processes: p50 {bare:.0} ns bare, {hooked:.0} ns hooked");
    rows.push(Row::added("hook start-up: first CUDA call (context), 64 processes at once, p50", hooked - bare, "ns added", bare, "ns, no hook"));
    Ok(())
}

/// Median ns per pair over REPEATS runs.
fn median_pair(setup: &Setup, ledger: Option<&Path>, steps: &[&str]) -> Result<f64> {
    let mut samples = Vec::with_capacity(REPEATS);
    for _ in 0..REPEATS {
        let node = format!("bench-{}", std::process::id());
        let output = setup.command(&node, ledger, steps).output().context("cannot run the workload")?;
        setup.cleanup(&node);
        if let Some(ledger) = ledger {
            let _ = fs::remove_file(ledger);
        }
        samples.push(field(&output, "bench ", "ns_per_pair=")?);
    }
    Ok(median(samples))
}

/// Median over 8 concurrent processes of their ns per pair.
fn contended_pair(setup: &Setup, ledger: Option<&Path>, steps: &[&str]) -> Result<f64> {
    let node = format!("bench8-{}", std::process::id());
    let children: Vec<Child> = (0..8)
        .map(|_| setup.command(&node, ledger, steps).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn())
        .collect::<std::io::Result<_>>()
        .context("cannot start the workloads")?;
    let mut samples = Vec::new();
    for child in children {
        samples.push(field(&child.wait_with_output()?, "bench ", "ns_per_pair=")?);
    }
    setup.cleanup(&node);
    if let Some(ledger) = ledger {
        let _ = fs::remove_file(ledger);
    }
    Ok(median(samples))
}

/// p50 over 64 processes started together of their first CUDA call after cuInit.
fn first_call(setup: &Setup, ledger: Option<&Path>) -> Result<f64> {
    let node = format!("bench64-{}", std::process::id());
    let children: Vec<Child> = (0..64)
        .map(|_| setup.command(&node, ledger, &["timed ctx 0"]).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn())
        .collect::<std::io::Result<_>>()
        .context("cannot start the workloads")?;
    let mut samples = Vec::new();
    for child in children {
        samples.push(field(&child.wait_with_output()?, "timed ", "ns=")?);
    }
    setup.cleanup(&node);
    if let Some(ledger) = ledger {
        let _ = fs::remove_file(ledger);
    }
    Ok(median(samples))
}

/// The number after `key` on the workload's line starting with `prefix`.
fn field(output: &std::process::Output, prefix: &str, key: &str) -> Result<f64> {
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        bail!("benchmark workload failed: {}{}", stdout, String::from_utf8_lossy(&output.stderr));
    }
    stdout
        .lines()
        .find_map(|line| line.strip_prefix(prefix)?.split_whitespace().find_map(|f| f.strip_prefix(key)))
        .and_then(|value| value.parse::<f64>().ok())
        .with_context(|| format!("the workload printed no `{prefix}... {key}` line: {stdout}"))
}

fn median(samples: Vec<f64>) -> f64 {
    Spread::of(&samples).median
}

fn write_report(rows: &[Row], cold: &str, agent: &str) -> Result<()> {
    let mut text = String::from(
        "# Benchmarks\n\nWritten by `cargo xtask bench` against the fake driver (release builds); single-process \
         figures are the median of 7 runs. The eBPF rows come from 21 rounds of the five \
         configurations, interleaved (each round starting with another); each figure is the \
         median over the rounds, against its round's bare run, with its interquartile range. The ledger's and the agent's criterion benchmarks \
         (`cargo bench -p ledger`, `cargo bench -p agent`) run with 1 s of warm-up and 3 s of \
         measurement; their rows give criterion's median estimate (where the ledger's time goes: \
         ledger-benchmarks.md).\n\n",
    );
    let _ = writeln!(text, "Machine: {}; date: {}.\n", machine(), today());
    text.push_str("| name | figure | unit | baseline | ratio |\n|---|---|---|---|---|\n");
    for row in rows {
        let _ = writeln!(text, "{}", row.line());
    }
    text.push_str(
        "\nTwo kinds of rows. Costs (the hook and the probes): the figure is what vramguard adds, \
         the baseline the fake driver's own cost, and the ratio (baseline + figure) / baseline, \
         how many times the bare call's time the call takes with vramguard. On a real H100 the \
         driver's own pair costs about 80-100 us and a context about 518 MiB and many \
         milliseconds (docs/design.md, \"Platform facts\"), so added costs are to be read against those, not against \
         the fake. Targets (the node agent, ratio marked \"of target\"): the baseline is the \
         issue's target or requirement and the ratio figure / target, under 1 when it is met.\n",
    );
    text.push('\n');
    let path = root().join("docs/BENCHMARKS.md");
    // Sections measured by hand (e.g. the Kubernetes client's build cost) are kept as they are.
    if let Ok(old) = fs::read_to_string(&path) {
        for section in kept_sections(&old) {
            text.push_str(section.trim_end());
            text.push_str("\n\n");
        }
    }
    text.push_str(cold.trim_end());
    text.push_str("\n\n");
    text.push_str(agent);
    fs::create_dir_all(root().join("docs"))?;
    fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
    println!("wrote {}", path.display());
    Ok(())
}

fn machine() -> String {
    let cpu = fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| info.lines().find_map(|l| l.strip_prefix("model name").map(|m| m.trim_start_matches([' ', '\t', ':']).to_string())))
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let kernel = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!("{cpu}, {cores} cores, Linux {}", kernel.trim())
}

fn today() -> String {
    Command::new("date")
        .arg("+%Y-%m-%d")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_report_keeps_the_sections_it_does_not_write() {
        let old = "# Benchmarks\n\nintro\n\n| a | b |\n\n## The Kubernetes client\n\nby hand\n\n## The node agent\n\nrows\n";
        let kept = kept_sections(old);
        assert_eq!(kept, vec!["## The Kubernetes client\n\nby hand\n\n"]);
        assert!(kept_sections("# Benchmarks\n\n## The node agent\n\nrows\n").is_empty());
    }

    #[test]
    fn the_cold_start_section_is_replaced_in_place_or_put_before_the_agents() {
        let heading = cold_start::HEADING;
        let old = format!("# B\n\nintro\n\n## Other\n\nx\n\n{heading}\n\nold\n\n## The node agent\n\nrows\n");
        let new = replace_section(&old, heading, &format!("{heading}\n\nnew\n"));
        assert_eq!(new, format!("# B\n\nintro\n\n## Other\n\nx\n\n{heading}\n\nnew\n\n## The node agent\n\nrows\n"));
        let without = "# B\n\nintro\n\n## The node agent\n\nrows\n";
        let new = replace_section(without, heading, &format!("{heading}\n\nnew"));
        assert_eq!(new, format!("# B\n\nintro\n\n{heading}\n\nnew\n\n## The node agent\n\nrows\n"));
    }
}
