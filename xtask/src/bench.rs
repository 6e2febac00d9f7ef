//! `cargo xtask bench`: what the eBPF probes cost a workload, measured against the fake
//! driver (release build) with and without `vramguard run` attached, written to
//! docs/BENCHMARKS.md with the machine and the date.
//!
//! Two cases: an alloc/free pair of 1 KiB while another small allocation stays live (the
//! fake driver's charge does not change, so the pair is cheap and the probes dominate), and a
//! pair of 2 MiB (each call changes the device's shared counters under its file lock).
use std::{
    fmt::Write as _,
    fs,
    path::Path,
    process::Command,
};

use anyhow::{bail, Context, Result};
use e2e::agent::Agent;

use crate::{build_ebpf, cargo, root, run, setup};

/// Repeats of each measurement; the median is reported.
const REPEATS: usize = 7;

struct Case {
    name: &'static str,
    pairs: u64,
    steps: &'static [&'static str],
}

const CASES: [Case; 2] = [
    Case { name: "alloc+free 1 KiB pair", pairs: 200_000, steps: &["ctx 0", "alloc keep 512", "bench 200000 1k"] },
    Case { name: "alloc+free 2 MiB pair", pairs: 50_000, steps: &["ctx 0", "bench 50000 2m"] },
];

pub fn bench() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the benchmark attaches eBPF programs: run it as root");
    }
    setup::setup()?;
    build_ebpf()?;
    run(cargo().args(["build", "--release", "-p", "fakecuda", "-p", "workload"]))?;
    run(cargo().args(["build", "-p", "agent"]))?;
    let release = root().join("target/release");
    let lib_dir = e2e::fake_driver_dir_in(&release)?;
    let workload = release.join("fakecuda-workload");

    let mut rows = Vec::new();
    for case in &CASES {
        let bare = median(&workload, &lib_dir, case)?;
        let agent = Agent::start(&lib_dir.join("libcuda.so.1"))?;
        let probed = median(&workload, &lib_dir, case)?;
        let audit = agent.audit()?;
        agent.stop()?;
        let seen = audit["stats"]["events_alloc"].as_u64().unwrap_or(0);
        if seen < case.pairs {
            bail!("the probes saw {seen} allocations of a run of {} pairs: not attached?", case.pairs);
        }
        println!("{}: {bare:.0} ns without probes, {probed:.0} ns with ({:+.0} ns)", case.name, probed - bare);
        rows.push((case.name, bare, probed));
    }
    write_report(&rows)
}

/// Median ns per pair over REPEATS runs of the case.
fn median(workload: &Path, lib_dir: &Path, case: &Case) -> Result<f64> {
    let mut samples = Vec::with_capacity(REPEATS);
    for _ in 0..REPEATS {
        let node = format!("bench-{}", std::process::id());
        let output = Command::new(workload)
            .env("LD_LIBRARY_PATH", lib_dir)
            .env("FAKECUDA_NODE", &node)
            .env("FAKECUDA_DEVICE_BYTES", "16g")
            .args(case.steps)
            .output()
            .with_context(|| format!("cannot run {}", workload.display()))?;
        let _ = fs::remove_file(format!("/dev/shm/{node}-dev0"));
        let stdout = String::from_utf8_lossy(&output.stdout);
        if !output.status.success() {
            bail!("benchmark workload failed: {}{}", stdout, String::from_utf8_lossy(&output.stderr));
        }
        let ns = stdout
            .lines()
            .find_map(|line| line.strip_prefix("bench ")?.split_whitespace().find_map(|f| f.strip_prefix("ns_per_pair=")))
            .and_then(|value| value.parse::<f64>().ok())
            .context("the workload printed no `bench ... ns_per_pair=` line")?;
        samples.push(ns);
    }
    samples.sort_by(f64::total_cmp);
    Ok(samples[samples.len() / 2])
}

fn write_report(rows: &[(&str, f64, f64)]) -> Result<()> {
    let mut text = String::from(
        "# Benchmarks\n\nWritten by `cargo xtask bench`; each figure is the median of 7 runs.\n\n",
    );
    let _ = writeln!(text, "Machine: {}; date: {}.\n", machine(), today());
    text.push_str("| name | figure | unit | baseline | ratio |\n|---|---|---|---|---|\n");
    for (name, bare, probed) in rows {
        let _ = writeln!(
            text,
            "| probe cost, {name} | {:.0} | ns added per pair | {bare:.0} ns without probes | {:.2} |",
            probed - bare,
            probed / bare
        );
    }
    text.push_str(
        "\nBaseline: the fake driver's own cost per pair (release build), no eBPF attached. \
         Figure: what `vramguard run` attached to the same library adds (entry and return \
         probes on the allocation, entry probe on the free, map updates, one ring-buffer \
         record per call). On a real H100 the driver's own pair costs about 80-100 us \
         (DESIGN.md §5), so the added cost is to be read against that, not against the fake.\n",
    );
    let path = root().join("docs/BENCHMARKS.md");
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
