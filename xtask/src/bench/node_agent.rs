//! The node agent's own costs, against the targets of the issue "The agent": resident memory
//! under 64 MiB and idle CPU under 1% of one core while it watches 100 ledgers, and a killed
//! process's slot freed within 1 s; and, from issue 17, how its reconcile passes, reclaims and
//! `/healthz` answers fare beside hostile tenants.
//!
//! The agent is the release build, run as the DaemonSet runs it (`--ledger-dir`,
//! `--metrics-addr`, `--health-addr`, libcuda discovery on) with the fake driver given by `--libcuda`. Its
//! ledger directory holds 100 container directories, each with a ledger made the agent's way
//! (1024 slots, the hook's 65536 records, a 1 GiB quota); the workloads are the end-to-end
//! kit's hooked `fakecuda-workload`s, each holding a context and 100 MiB, then asleep.
//!
//! - Memory and idle CPU ([`Idle`]): two holders in each of the first 50 ledgers; once the
//!   agent has recorded every holder's host pid, 5 s to settle, then a 20 s window with no
//!   allocation (checked: the probes' alloc and free counters do not move): VmRSS each second
//!   (the most is reported), VmHWM at the end, utime + stime from `/proc/<pid>/stat` across
//!   it. The CPU again in a new agent started beside the running holders (as after a
//!   restart: its probes never saw their allocations).
//! - Reclaim ([`Reclaimed`]): with those holders still there, a new holder in each of the 100
//!   ledgers (20 at a time), each let past its checkpoint in turn, to write its clock to a
//!   file and SIGKILL itself (the workload's `kill PATH` step: the exit itself, with no
//!   wake-up of a sleeping process before it) and be left a zombie (as a parent slow to reap
//!   would) while its slot is read in the ledger file every 200 us, without the ledger's lock,
//!   by a thread under `SCHED_FIFO` ([`Prompt`]), until it is free; the time runs from its
//!   clock. The agent's own figure for each, from its exit event,
//!   comes from its log (`latency_us=`); its histogram (`vramguard_reclaim_latency_seconds`)
//!   must have counted every reclaim. `/healthz` is asked on the health listener every 20 ms
//!   throughout ([`Health`]).
//! - Reconcile passes ([`Measured`]): the agent's `vramguard_reconcile_pass_seconds` across
//!   the idle window and the reclaims (mean; p50 and p99 from its buckets).
//! - Configurations, each a new agent measured by the same code ([`Measured::of`]): none
//!   hostile; one hostile ledger of the largest geometry, scribbled on ([`Hostile`]); 50
//!   hostile ledgers (`e2e::hostile::HostileLedgers`) and a process mapping a crafted ELF
//!   file ([`ManyHostile`]).
//! - Stops ([`Stops`]): agents started beside the holders and stopped by SIGTERM, with the
//!   probes as uprobe_multi links (the default) and as perf events, side by side.
use std::{
    ffi::OsStr,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};
use e2e::{
    agent::Agent,
    crafted_elf::MOST_SYMBOLS,
    holding,
    hostile::{worker_pids, HealthProbe, HostileLedgers, OWED},
    http::{samples, scrape, Sample},
    ledgers, wait_for, FakeNode, Running, TempDir, GIB, MIB,
};

use super::{Row, Spread};

/// Container directories under `--ledger-dir`, each with a ledger.
const LEDGERS: usize = 100;
/// The hook's geometry (hook/src/session.rs), which an agent-made ledger should match.
const SLOTS: u32 = 1024;
const RECORDS: u32 = 1 << 16;
/// Each ledger's quota and context reserve (the fake's context size).
const LIMIT: u64 = GIB;
const CONTEXT: u64 = 64 * MIB;
/// Ledgers with sleeping holders while the agent idles, and holders in each.
const BUSY_LEDGERS: usize = 50;
const HOLDERS_PER_LEDGER: usize = 2;
/// What each holder allocates after its context.
const HOLDING: &str = "alloc held 100m";
/// From every slot's host pid recorded to the idle window.
const SETTLE: Duration = Duration::from_secs(5);
const IDLE_WINDOW: Duration = Duration::from_secs(20);
/// Killed holders (one per ledger), started this many at a time.
const VICTIMS: usize = LEDGERS;
const BATCH: usize = 20;
/// How often a killed holder's slot is looked at.
const POLL: Duration = Duration::from_micros(200);
/// Between one freed slot and the next kill.
const GAP: Duration = Duration::from_millis(20);
/// A slot not freed by then was never going to be: the benchmark fails.
const NEVER: Duration = Duration::from_secs(10);
/// The issues' targets: "The agent" (memory, a pass's mean, a reclaim within 1 s) and "The
/// agent never takes the node down with it", item 5 (idle CPU, a pass's and a reclaim's p99).
const RSS_TARGET_MIB: f64 = 64.0;
const CPU_TARGET_PERCENT: f64 = 0.5;
/// The target for a reconcile pass's mean and p50, in ms.
const PASS_TARGET_MS: f64 = 10.0;
/// The target for a reconcile pass's p99 (beside 50 hostile ledgers), in ms.
const PASS_P99_TARGET_MS: f64 = 50.0;
const RECLAIM_REQUIRED_MS: f64 = 1000.0;
/// The target for exit-to-reclaim's p99 (beside 50 hostile ledgers), in ms.
const RECLAIM_P99_TARGET_MS: f64 = 5.0;

/// What an exit-to-reclaim percentile row is held to: p99 to its target, p50 to the 1 s
/// requirement.
fn reclaim_target(name: &str) -> (f64, &'static str) {
    if name == "p99" {
        (RECLAIM_P99_TARGET_MS, "ms, target")
    } else {
        (RECLAIM_REQUIRED_MS, "ms, required")
    }
}

/// Measures the agent at `bin` (a release build); adds its rows, and how they were measured
/// to `notes`.
pub fn node_agent(bin: &Path, rows: &mut Vec<Row>, notes: &mut Vec<String>) -> Result<()> {
    let node = FakeNode::new("bench-agent").with_env("FAKECUDA_DEVICE_BYTES", "64g").with_env("FAKECUDA_CONTEXT_BYTES", "64m");
    let dir = TempDir::new("bench-ledgers")?;
    let paths: Vec<PathBuf> = (0..LEDGERS)
        .map(|i| {
            let path = dir.ledger(&format!("pod-{i:03}"))?;
            ledgers::create(&path, SLOTS, RECORDS, LIMIT, CONTEXT)?;
            Ok(path)
        })
        .collect::<Result<_>>()?;
    let agent = start(bin, dir.path(), 0, &node, Nvml::Fake, &[])?;
    let mut holders = Vec::new();
    for path in &paths[..BUSY_LEDGERS] {
        for _ in 0..HOLDERS_PER_LEDGER {
            holders.push((path.as_path(), holder(&node, path)?));
        }
    }
    recorded(&agent, &holders)?;
    let plain = Measured::of(&agent, &node, &paths)?;
    // Again at once: every ledger's worker, started by its first reclaim, still runs.
    let workers = worker_pids(agent.pid()).len();
    ensure!(workers >= LEDGERS, "{workers} ledger workers run after a reclaim in each of the {LEDGERS} ledgers");
    let warm = Reclaimed::measure(&agent, &node, &paths)?;
    agent.stop()?;
    // A new agent beside the running holders, as after an agent's restart: its probes never
    // saw their allocations.
    let restarted = start(bin, dir.path(), 0, &node, Nvml::Fake, &[])?;
    let after_restart = Idle::measure(&restarted)?;
    restarted.stop()?;
    // The same idle window without the driver view (the fake NVML made absent): what the
    // driver view adds to a pass.
    let blind = start(bin, dir.path(), 0, &node, Nvml::Absent, &[])?;
    let without_nvml = Idle::measure(&blind)?;
    blind.stop()?;
    // A third agent, with one hostile ledger beside the others.
    let hostile = Hostile::plant(dir.path())?;
    let beside = start(bin, dir.path(), 1, &node, Nvml::Fake, &[])?;
    let one_hostile = Measured::of(&beside, &node, &paths)?;
    beside.stop()?;
    drop(hostile);
    // A fourth, with many hostile tenants and a crafted ELF file.
    let many = ManyHostile::measure(bin, &dir, &node, &paths)?;
    let stops = Stops::measure(bin, &dir, &node)?;
    let held = holders.len();
    drop(holders);

    let idle = &plain.idle;
    let mib = |kib: u64| kib as f64 / 1024.0;
    println!(
        "agent idle: VmRSS {:.1} MiB (most), VmHWM {:.1} MiB, CPU {:.3}% of a core ({:.3}% after a restart)",
        mib(idle.rss_kib),
        mib(idle.hwm_kib),
        idle.cpu_percent,
        after_restart.cpu_percent
    );
    let setup = format!("{LEDGERS} ledgers of {SLOTS} slots, {held} hooked holders in {BUSY_LEDGERS} of them");
    let cpu = |figure: f64, how: &str| {
        Row::target(format!("agent idle CPU{how}: {setup}"), figure, "% of one core", 2, CPU_TARGET_PERCENT, "% of one core, target")
    };
    rows.extend([
        Row::target(format!("agent resident memory, idle (VmRSS): {setup}"), mib(idle.rss_kib), "MiB", 1, RSS_TARGET_MIB, "MiB, target"),
        Row::target(format!("agent peak resident memory (VmHWM): {setup}"), mib(idle.hwm_kib), "MiB", 1, RSS_TARGET_MIB, "MiB, target"),
        cpu(idle.cpu_percent, ""),
        cpu(after_restart.cpu_percent, ", restarted beside the running holders"),
    ]);
    let many_beside = format!(", {} hostile ledgers and a crafted ELF file present", ManyHostile::LEDGERS);
    for (name, quantile) in [("p50", 0.50), ("p99", 0.99)] {
        let (target, label) = reclaim_target(name);
        rows.push(Row::target(
            format!("exit-to-reclaim {name}: exit to slot freed in the ledger, a second round at once (every ledger's worker running)"),
            percentile(&warm.seen, quantile),
            "ms",
            2,
            target,
            label,
        ));
    }
    for (measured, beside) in [(&plain, ""), (&one_hostile, ", one hostile ledger present"), (&many.measured, many_beside.as_str())] {
        measured.rows(rows, &setup, beside);
    }
    for (what, idle) in [("with the driver view (the fake NVML)", &after_restart), ("without it (FAKECUDA_NVML=absent)", &without_nvml)] {
        rows.push(Row::target(
            format!("agent reconcile pass mean, idle window, restarted beside the holders, {what}: {setup}"),
            idle.pass_mean_ms,
            "ms",
            3,
            PASS_TARGET_MS,
            "ms, target",
        ));
    }
    notes.push(format!(
        "The agent: the release build, `vramguard run --libcuda <fake> --ledger-dir DIR --metrics-addr 127.0.0.1:0 \
         --health-addr 127.0.0.1:0`, with discovery of libcuda files in running processes on, as the DaemonSet runs it. DIR holds {LEDGERS} \
         container directories with a ledger each, made the agent's way ({SLOTS} slots, {RECORDS} records, a {} GiB \
         quota). The holders are debug builds of the end-to-end kit's hooked `fakecuda-workload` (`ctx 0`, \
         `{HOLDING}`, then asleep): {held}, {HOLDERS_PER_LEDGER} in each of {BUSY_LEDGERS} ledgers, live throughout. \
         The agent is started before them; after the reclaim measurement it is stopped and a new one started beside \
         them (\"restarted\"), whose probes never saw their allocations. Each configuration below (none, one hostile \
         ledger, {} hostile ledgers and a crafted ELF file) is a new agent measured by the same code: the idle window, \
         then the reclaim measurement with `/healthz` probed throughout.",
        LIMIT / GIB,
        ManyHostile::LEDGERS,
    ));
    notes.push(format!(
        "Memory and CPU: once the agent had recorded every holder's host pid, {} s to settle, then a window of \
         {:.1} s in which the probes' alloc and free counters did not move (a window in which they did is \
         discarded and measured again, {WINDOW_TRIES} tries at most), with {} processes on the machine. VmRSS from \
         /proc/<pid>/status each second (the most is reported; at the end RssAnon {:.1} MiB, RssFile {:.1} MiB, \
         RssShmem {:.1} MiB: RssFile counts the binary's and the ledgers' mapped pages), VmHWM after it. CPU: \
         utime + stime from /proc/<pid>/stat across the window: {} clock ticks at {} Hz (resolution {:.2}%); the \
         restarted agent: {} ticks over {:.1} s, VmRSS {:.1} MiB.",
        SETTLE.as_secs(),
        idle.window.as_secs_f64(),
        idle.processes,
        mib(idle.anon_kib),
        mib(idle.file_kib),
        mib(idle.shmem_kib),
        idle.ticks,
        idle.hz,
        100.0 / idle.hz / idle.window.as_secs_f64(),
        after_restart.ticks,
        after_restart.window.as_secs_f64(),
        mib(after_restart.rss_kib),
    ));
    let many_name = format!("{} hostile ledgers and the ELF file", ManyHostile::LEDGERS);
    let configurations = [("no hostile tenant", &plain), ("one hostile ledger", &one_hostile), (many_name.as_str(), &many.measured)];
    notes.push(Passes::note(configurations));
    notes.push(plain.reclaimed.note());
    notes.push(format!(
        "A second round at once, without hostile ledgers: the same measurement again in the same agent, right \
         after the first, when each ledger's confined worker (`vramguard ledger-worker`, started by the ledger's \
         first locked operation, stopped after {} s without one) still runs ({workers} workers ran before it): \
         every reclaim of the first round started its ledger's worker (fork and exec of the agent's binary, its \
         confinement, the hello), none of the second did. Slowest {:.2} ms; the agent's own figure p50 {:.2} ms, \
         p99 {:.2} ms.",
        IDLE_WORKER.as_secs(),
        warm.seen.last().copied().unwrap_or(f64::NAN),
        percentile(&warm.logged, 0.50),
        percentile(&warm.logged, 0.99),
    ));
    notes.push(Health::note(configurations));
    stops.rows(rows);
    notes.push(stops.note());
    notes.push(format!(
        "The driver view: each agent loads the fake NVML beside the fake libcuda, with the node's variables, so it \
         lists the node's processes and their memory as the fake driver holds it (every holder, its context \
         included); `vramguard_driver_read_seconds` is the agent's own histogram of one read (all devices' \
         compute and graphics processes), timed on its reader thread, scraped before and after each configuration \
         as the passes are (buckets 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 50, 250 ms, 2 s). The read runs off the \
         reconcile task (a pass joins the latest answer), so a pass's time includes the join, not the read. The \
         last two pass rows compare like with like: the restarted agent's idle window (driver view on, {:.0} passes) \
         and the same window in one more agent started beside the same holders with `FAKECUDA_NVML=absent` ({:.0} \
         passes); neither agent's probes saw the holders' allocations.",
        after_restart.passes,
        without_nvml.passes,
    ));
    notes.push(format!(
        "One hostile ledger present: a third agent watches the same {LEDGERS} ledgers plus a hostile container's, of \
         the largest geometry the agent allows by default ({} slots, {} records), every slot naming a dead process \
         and a thread of the benchmark keeping its `dirty` flag raised and its lock's owner and list words \
         rewritten (every locked operation on it repairs the whole ledger first). The agent reads it from copies and \
         hands its reclaims to a confined worker, at most {} ms of worker time per sweep. Reclaims as above, in the \
         benchmark's ledgers (slowest {:.2} ms; {} of {VICTIMS} from exit events).",
        Hostile::SLOTS,
        Hostile::RECORDS,
        100,
        one_hostile.reclaimed.seen.last().copied().unwrap_or(f64::NAN),
        one_hostile.reclaimed.from_events,
    ));
    notes.push(many.note());
    Ok(())
}

/// How long a ledger's worker outlives its last call (the agent's `ledgers::worker::IDLE`).
const IDLE_WORKER: Duration = Duration::from_secs(60);

/// How often `/healthz` is asked on the health listener during a reclaim measurement.
const HEALTH_EVERY: Duration = Duration::from_millis(20);
/// Issue 17's bound on a `/healthz` answer while tenants attack.
const HEALTH_REQUIRED_MS: f64 = 250.0;

/// One configuration of the agent, measured: idle, then its reclaims with `/healthz` probed
/// throughout, and its reconcile passes across both.
struct Measured {
    idle: Idle,
    reclaimed: Reclaimed,
    health: Health,
    /// `vramguard_reconcile_pass_seconds` from before the idle window to after the reclaims.
    passes: Histogram,
    /// `vramguard_driver_read_seconds` over the same span, and the processes the last read
    /// reported (series of `vramguard_driver_process_memory_bytes`).
    reads: Histogram,
    driver_processes: usize,
}

impl Measured {
    /// Measures `agent`, which watches `paths` (and maybe more) and has recorded the holders.
    fn of(agent: &Agent, node: &FakeNode, paths: &[PathBuf]) -> Result<Measured> {
        let first = scrape(agent.metrics_addr()?)?;
        let (before, reads_before) = (Histogram::of(&first, PASS_SECONDS)?, Histogram::of(&first, READ_SECONDS)?);
        let idle = Idle::measure(agent)?;
        let probe = HealthProbe::start(agent.health_addr()?, HEALTH_EVERY);
        let reclaimed = Reclaimed::measure(agent, node, paths);
        let health = Health::of(probe.answers()?)?;
        let reclaimed = reclaimed?;
        let last = scrape(agent.metrics_addr()?)?;
        let passes = Histogram::of(&last, PASS_SECONDS)?.since(&before);
        ensure!(passes.count > 0, "the agent timed no reconcile pass during the measurement");
        let reads = Histogram::of(&last, READ_SECONDS)?.since(&reads_before);
        ensure!(single(&last, "vramguard_driver_up")? == 1.0, "the agent's driver view does not answer: {}", agent.log());
        ensure!(reads.count > 0, "the agent timed no NVML read during the measurement");
        let driver_processes = samples(&last, "vramguard_driver_process_memory_bytes").count();
        println!(
            "reconcile passes: {}; NVML reads (fake): {}, {driver_processes} processes in the last; /healthz: {} probes, p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms, {} failed",
            passes.summary(),
            reads.summary(),
            health.ms.len(),
            percentile(&health.ms, 0.50),
            percentile(&health.ms, 0.99),
            health.ms.last().copied().unwrap_or(f64::NAN),
            health.failed.len(),
        );
        Ok(Measured { idle, reclaimed, health, passes, reads, driver_processes })
    }

    /// The rows of this configuration: its passes, reclaims and `/healthz` answers.
    fn rows(&self, rows: &mut Vec<Row>, setup: &str, beside: &str) {
        let pass = |what: &str, seconds: f64, target: f64| {
            Row::target(
                format!("agent reconcile pass {what}, idle window and reclaims{beside}: {setup}"),
                seconds * 1e3,
                "ms",
                3,
                target,
                "ms, target",
            )
        };
        rows.extend([
            pass("mean", self.passes.mean(), PASS_TARGET_MS),
            pass("p50 (from the histogram's buckets)", self.passes.quantile(0.50), PASS_TARGET_MS),
            pass("p99 (from the histogram's buckets)", self.passes.quantile(0.99), PASS_P99_TARGET_MS),
        ]);
        for (what, seconds) in [("p50", self.reads.quantile(0.50)), ("p99", self.reads.quantile(0.99))] {
            rows.push(Row::reported(
                format!("one NVML read {what} (the fake NVML, {} processes listed){beside}", self.driver_processes),
                seconds * 1e3,
                "ms",
                3,
            ));
        }
        self.reclaimed.rows(rows, beside);
        let health = &self.health.ms;
        for (name, figure) in [
            ("p50", percentile(health, 0.50)),
            ("p99", percentile(health, 0.99)),
            ("max", health.last().copied().unwrap_or(f64::NAN)),
        ] {
            rows.push(Row::target(
                format!("`/healthz` on the health listener {name}, every {} ms during the reclaims{beside}", HEALTH_EVERY.as_millis()),
                figure,
                "ms",
                2,
                HEALTH_REQUIRED_MS,
                "ms, required",
            ));
        }
    }
}

/// The answers of `/healthz` probes: the latencies of those answered 200 (ms, sorted) and
/// what the others got.
struct Health {
    ms: Vec<f64>,
    failed: Vec<String>,
}

impl Health {
    fn of(answers: Vec<(Duration, Result<u16, String>)>) -> Result<Health> {
        ensure!(!answers.is_empty(), "no /healthz probe ran");
        let mut ms = Vec::with_capacity(answers.len());
        let mut failed = Vec::new();
        for (took, answer) in answers {
            match answer {
                Ok(200) => ms.push(took.as_secs_f64() * 1e3),
                Ok(status) => failed.push(format!("status {status} after {took:?}")),
                Err(error) => failed.push(format!("{error} after {took:?}")),
            }
        }
        ms.sort_by(f64::total_cmp);
        Ok(Health { ms, failed })
    }

    fn note<'a>(configurations: impl IntoIterator<Item = (&'a str, &'a Measured)>) -> String {
        let each: Vec<String> = configurations
            .into_iter()
            .map(|(name, m)| {
                let failed = match m.health.failed.first() {
                    None => "none failed".to_string(),
                    Some(first) => format!("{} failed (the first: {first})", m.health.failed.len()),
                };
                format!("{name}: {} answered, {failed}", m.health.ms.len())
            })
            .collect();
        format!(
            "`/healthz`: asked on the health listener (`--health-addr`) every {} ms by a thread of the benchmark for \
             the whole reclaim measurement (the holders' start-up included), each probe a new TCP connection, timed \
             from connect to the end of the answer; the rows give the answers with status 200 (nearest-rank) against \
             issue 17's bound, 250 ms. Probes: {}.",
            HEALTH_EVERY.as_millis(),
            each.join("; "),
        )
    }
}

/// The reconcile pass histogram's name.
const PASS_SECONDS: &str = "vramguard_reconcile_pass_seconds";
/// The NVML read histogram's name.
const READ_SECONDS: &str = "vramguard_driver_read_seconds";

/// What the pass rows say.
struct Passes;

impl Passes {
    fn note<'a>(configurations: impl IntoIterator<Item = (&'a str, &'a Measured)>) -> String {
        let each: Vec<String> = configurations
            .into_iter()
            .map(|(name, m)| {
                format!(
                    "{name}: {} passes, p50 within le={} s, p99 within le={} s (mean over the idle window alone {:.3} ms, {:.0} passes)",
                    m.passes.count,
                    m.passes.bound(0.50),
                    m.passes.bound(0.99),
                    m.idle.pass_mean_ms,
                    m.idle.passes,
                )
            })
            .collect();
        format!(
            "Reconcile passes: the agent's own `{PASS_SECONDS}` histogram, scraped before the idle window (its settling \
             time included) and after the reclaim measurement, the difference taken: the mean is its sum over its \
             count, p50 and p99 are interpolated linearly within the bucket that holds them (as Prometheus's \
             `histogram_quantile` does; the buckets are 0.1, 0.25, 0.5, 1, 2.5, 10, 25, 100 ms and 1 s, so a \
             quantile is only as fine as its bucket). {}.",
            each.join("; "),
        )
    }
}

/// The fourth configuration: [`ManyHostile::LEDGERS`] hostile tenants' ledgers (the attack of
/// `tests/hostile_many.rs`: locks held, dead slots, charges owed) beside the benchmark's, and
/// a process mapping a crafted ELF file executable (the worst shape of
/// `tests/hostile_discovery.rs`).
struct ManyHostile {
    measured: Measured,
    /// How long after the attack began the agent reported every hostile ledger backed off,
    /// and the crafted file skipped (s).
    backed_off_s: f64,
    elf_bytes: u64,
    elf_reason: String,
}

impl ManyHostile {
    const LEDGERS: usize = 50;
    /// How long the hostile ledgers' locks stay held: past the configuration's end.
    const HELD_FOR: Duration = Duration::from_secs(240);

    fn measure(bin: &Path, dir: &TempDir, node: &FakeNode, paths: &[PathBuf]) -> Result<ManyHostile> {
        use e2e::crafted_elf::{Crafted, Hash, Names};
        let attacker = TempDir::new("bench-crafted-elf")?;
        let elf = attacker.path().join("libcuda.so.1");
        std::fs::write(&elf, Crafted::new(MOST_SYMBOLS, Names::WithoutNul, Hash::None).bytes())?;
        let metadata = std::fs::metadata(&elf)?;
        let id = (metadata.dev(), metadata.ino());
        let mut mapper = node.workload().steps([format!("map {}", elf.display()), "checkpoint mapped".into(), "hold".into()]).spawn()?;
        mapper.wait_checkpoint("mapped")?;
        let mut hostile = HostileLedgers::make(dir.path(), Self::LEDGERS, OWED)?;
        let agent = start(bin, dir.path(), Self::LEDGERS, node, Nvml::Fake, &[])?;
        let attacked = Instant::now();
        hostile.attack(Self::HELD_FOR)?;
        let names: Vec<String> = hostile.paths().iter().map(|p| p.display().to_string()).collect();
        let mut elf_reason = None;
        wait_for(Duration::from_secs(30), "every hostile ledger backed off and the crafted file skipped", || {
            let audit = agent.audit()?;
            let problems = &audit["ledger_problems"];
            let backed_off = names.iter().all(|name| problems[name.as_str()].as_str().is_some_and(|p| p.contains("lock stayed held")));
            let skipped = audit["discovery"]["skipped"].as_array().and_then(|skipped| {
                skipped.iter().find(|s| (s["dev"].as_u64(), s["ino"].as_u64()) == (Some(id.0), Some(id.1))).cloned()
            });
            elf_reason = skipped.map(|s| s["reason"].as_str().unwrap_or_default().to_string());
            Ok(backed_off && elf_reason.is_some())
        })
        .with_context(|| format!("agent log: {}", agent.log()))?;
        let backed_off_s = attacked.elapsed().as_secs_f64();
        let measured = Measured::of(&agent, node, paths)?;
        ensure!(
            attacked.elapsed() < Self::HELD_FOR,
            "the hostile ledgers' locks were let go ({:?}) before the measurement ended",
            Self::HELD_FOR
        );
        agent.stop()?;
        // The hostile containers leave (their holders let go of the unlinked files later).
        for path in hostile.paths() {
            if let Some(container) = path.parent() {
                let _ = std::fs::remove_dir_all(container);
            }
        }
        drop((hostile, mapper));
        Ok(ManyHostile { measured, backed_off_s, elf_bytes: metadata.len(), elf_reason: elf_reason.unwrap_or_default() })
    }

    fn note(&self) -> String {
        let reclaimed = &self.measured.reclaimed;
        format!(
            "{} hostile ledgers and a crafted ELF file present: a fourth agent watches the same {LEDGERS} ledgers plus \
             {} hostile containers' (`e2e::hostile::HostileLedgers`, the attack of `tests/hostile_many.rs`): each \
             ledger's lock held by a live process throughout, a slot of a process that does not exist (a reclaim \
             owed, refused by the lock), and in {OWED} of them a hooked process that wrote its own charge down (a \
             charge owed). Before the agent starts, a process maps executable a crafted ELF file of {:.1} MiB \
             (`e2e::crafted_elf`: {MOST_SYMBOLS} dynamic symbols, a 4 MiB string table without a NUL byte, no hash \
             table), named libcuda.so.1. The measurement began once the agent reported every hostile ledger backed \
             off and the file skipped ({:.1} s after the attack began; the file's reason: \"{}\"). Reclaims as above, \
             in the benchmark's ledgers (slowest {:.2} ms; {} of {VICTIMS} from exit events).",
            Self::LEDGERS,
            Self::LEDGERS,
            self.elf_bytes as f64 / MIB as f64,
            self.backed_off_s,
            self.elf_reason,
            reclaimed.seen.last().copied().unwrap_or(f64::NAN),
            reclaimed.from_events,
        )
    }
}

/// Agents stopped by SIGTERM, as the kubelet stops one ([`Stops::ROUNDS`] of each kind of
/// probe link, the first kind alternating), beside the running holders.
struct Stops {
    /// Per kind (uprobe_multi, perf events): each stop's SIGTERM to exit, and the agent's own
    /// `probes=` (its probes detached) and `took=` (its tracepoints too), in ms.
    kinds: [Vec<(f64, f64, f64)>; 2],
}

impl Stops {
    const ROUNDS: usize = 5;
    const KINDS: [(&'static str, &'static [&'static str]); 2] =
        [("uprobe_multi links (the default)", &[]), ("perf events (`--uprobe-links perf`)", &["--uprobe-links", "perf"])];

    fn measure(bin: &Path, dir: &TempDir, node: &FakeNode) -> Result<Stops> {
        let mut kinds = [Vec::new(), Vec::new()];
        for round in 0..Self::ROUNDS {
            for turn in 0..2 {
                let kind = (round + turn) % 2;
                let agent = start(bin, dir.path(), 0, node, Nvml::Fake, Self::KINDS[kind].1)?;
                let started = Instant::now();
                let log = agent.stop()?;
                let stopped = started.elapsed().as_secs_f64() * 1e3;
                let line = log.lines().find(|line| line.contains("probes detached")).context("no `probes detached` line in the agent's log")?;
                let field = |name: &str| -> Result<f64> {
                    let value = line.split(&format!(" {name}=")).nth(1).and_then(|rest| rest.split_whitespace().next());
                    value.and_then(millis).with_context(|| format!("no {name}= in {line}"))
                };
                kinds[kind].push((stopped, field("probes")?, field("took")?));
            }
        }
        Ok(Stops { kinds })
    }

    fn rows(&self, rows: &mut Vec<Row>) {
        for ((kind, _), stops) in Self::KINDS.iter().zip(&self.kinds) {
            let median = |pick: fn(&(f64, f64, f64)) -> f64| Spread::of(&stops.iter().map(pick).collect::<Vec<_>>()).median;
            rows.push(Row::reported(format!("agent stop, SIGTERM to exit, {kind}: median of {} stops", stops.len()), median(|s| s.0), "ms", 0));
            rows.push(Row::reported(format!("agent stop, the probes' detaching, {kind}: median of {} stops", stops.len()), median(|s| s.1), "ms", 0));
        }
    }

    fn note(&self) -> String {
        let range = |stops: &[(f64, f64, f64)], pick: fn(&(f64, f64, f64)) -> f64| {
            let (low, high) = stops.iter().map(pick).fold((f64::INFINITY, f64::NEG_INFINITY), |(low, high), v| (low.min(v), high.max(v)));
            format!("{low:.0}-{high:.0} ms")
        };
        format!(
            "Agent stops: {} rounds, each starting an agent of each kind (the first alternating) on the same ledgers \
             beside the running holders and stopping it with SIGTERM, timed from the signal to the exit. The agent logs \
             its detaching (`probes detached links=N probes=... took=...`: `probes` the uprobes alone, `took` the \
             tracepoints too). uprobe_multi links: stops {}, probes {}, with the tracepoints {}; perf events: stops {}, \
             probes {}, with the tracepoints {}.",
            Self::ROUNDS,
            range(&self.kinds[0], |s| s.0),
            range(&self.kinds[0], |s| s.1),
            range(&self.kinds[0], |s| s.2),
            range(&self.kinds[1], |s| s.0),
            range(&self.kinds[1], |s| s.1),
            range(&self.kinds[1], |s| s.2),
        )
    }
}

/// Milliseconds in a duration as Rust's `Debug` writes it (`77.08ms`, `2.98s`, `950µs`).
fn millis(text: &str) -> Option<f64> {
    let unit = text.find(|c: char| c.is_alphabetic() || c == 'µ')?;
    let (number, unit) = text.split_at(unit);
    let number: f64 = number.parse().ok()?;
    match unit {
        "s" => Some(number * 1e3),
        "ms" => Some(number),
        "µs" | "us" => Some(number / 1e3),
        "ns" => Some(number / 1e6),
        _ => None,
    }
}

/// Whether the agent's driver view reads the fake NVML.
#[derive(Clone, Copy, PartialEq)]
enum Nvml {
    /// The fake NVML beside the fake libcuda, seeing the node's processes.
    Fake,
    /// The fake NVML made absent (`FAKECUDA_NVML=absent`): the agent runs without a driver view.
    Absent,
}

/// Starts the agent at `bin` (with `more` arguments) on the kit's fake driver and the ledgers
/// in `dir` (and `extra` more), with its health listener and the node's variables, so that the
/// fake NVML it loads sees the node's processes; waits until it watches every ledger there.
fn start(bin: &Path, dir: &Path, extra: usize, node: &FakeNode, nvml: Nvml, more: &[&str]) -> Result<Agent> {
    let libcuda = e2e::fake_driver_dir()?.join("libcuda.so.1");
    let mut args = e2e::agent::watching_args(&libcuda, dir);
    args.extend(more.iter().map(OsStr::new));
    let mut env = node.env().to_vec();
    if nvml == Nvml::Absent {
        env.push(("FAKECUDA_NVML".into(), "absent".into()));
    }
    let agent = Agent::start_binary_env(bin, &args, &env)?;
    let addr = agent.metrics_addr()?;
    wait_for(Duration::from_secs(5), "the agent watches every ledger", || {
        Ok(single(&scrape(addr)?, "vramguard_ledgers")? == (LEDGERS + extra) as f64)
    })
    .with_context(|| format!("agent log: {}", agent.log()))?;
    Ok(agent)
}

/// A hooked workload holding a context and [`HOLDING`] in the ledger at `path`, stopped at
/// its checkpoint: let past it, it writes its clock to `stamp` and SIGKILLs itself.
fn victim(node: &FakeNode, path: &Path, stamp: &Path) -> Result<Running> {
    let kill = format!("kill {}", stamp.display());
    let mut running = node.hooked(path, LIMIT)?.steps(["ctx 0", HOLDING, "checkpoint held", kill.as_str()]).spawn()?;
    running.wait_checkpoint("held")?;
    Ok(running)
}

/// The calling thread under `SCHED_FIFO` (the lowest real-time priority) while this lives:
/// the benchmark's reads of a slot are then made when it asks, not when two busy CPUs get to
/// them (the observer's own wake-ups are not the agent's latency). Where the benchmark may not
/// (not root), the thread stays as it was, said once.
struct Prompt(bool);

impl Prompt {
    fn now() -> Prompt {
        static SAID: std::sync::Once = std::sync::Once::new();
        let param = libc::sched_param { sched_priority: 1 };
        // SAFETY: sets the calling thread's policy from a valid sched_param.
        let set = unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) } == 0;
        if !set {
            let error = std::io::Error::last_os_error();
            SAID.call_once(|| eprintln!("the benchmark's slot reads stay SCHED_OTHER (SCHED_FIFO refused: {error})"));
        }
        Prompt(set)
    }
}

impl Drop for Prompt {
    fn drop(&mut self) {
        if self.0 {
            let param = libc::sched_param { sched_priority: 0 };
            // SAFETY: sets the calling thread's policy back from a valid sched_param.
            unsafe { libc::sched_setscheduler(0, libc::SCHED_OTHER, &param) };
        }
    }
}

/// `CLOCK_MONOTONIC` now, in ns (the clock the workload's `kill PATH` writes).
fn monotonic_ns() -> u64 {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: writes the clock's value into `now`, a valid timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

/// A hooked workload holding a context and [`HOLDING`] in the ledger at `path`.
fn holder(node: &FakeNode, path: &Path) -> Result<Running> {
    holding(node.hooked(path, LIMIT)?, &["ctx 0", HOLDING])
}

/// Waits until the agent has recorded the host pid of every holder's slot: it watches their
/// ledgers and judged them alive.
fn recorded(agent: &Agent, holders: &[(&Path, Running)]) -> Result<()> {
    let mut pending: Vec<(&Path, u32)> = holders.iter().map(|(path, running)| (*path, running.pid())).collect();
    wait_for(Duration::from_secs(10), "the agent records the host pid of every holder's slot", || {
        // Ledgers opened every 50 ms, not every millisecond.
        std::thread::sleep(Duration::from_millis(50));
        pending.retain(|(path, pid)| !ledgers::slots(path).is_ok_and(|slots| slots.contains(&(*pid, *pid))));
        Ok(pending.is_empty())
    })
    .with_context(|| format!("agent log: {}", agent.log()))?;
    Ok(())
}

/// Windows measured at most, when allocations by someone else spoil one.
const WINDOW_TRIES: usize = 3;

/// The agent's resident memory and CPU over a window without allocations.
struct Idle {
    /// VmRSS, the most of the samples; VmHWM; RssAnon, RssFile, RssShmem at the end (KiB).
    rss_kib: u64,
    hwm_kib: u64,
    anon_kib: u64,
    file_kib: u64,
    shmem_kib: u64,
    /// utime + stime over the window, clock ticks per second, and the window.
    ticks: u64,
    hz: f64,
    window: Duration,
    cpu_percent: f64,
    /// Processes on the machine at the end of the window.
    processes: usize,
    /// Reconcile passes the agent timed during the window, and their mean (ms).
    passes: f64,
    pass_mean_ms: f64,
}

impl Idle {
    /// Lets `agent` settle, then measures a window in which its probes see no allocation or
    /// free; fails if none of [`WINDOW_TRIES`] windows is such.
    fn measure(agent: &Agent) -> Result<Idle> {
        let pid = agent.pid();
        std::thread::sleep(SETTLE);
        for _ in 0..WINDOW_TRIES {
            let events_before = events(agent)?;
            let passes_before = pass_totals(agent)?;
            let ticks_before = cpu_ticks(pid)?;
            let start = Instant::now();
            let mut rss_kib = 0;
            while start.elapsed() < IDLE_WINDOW {
                std::thread::sleep(Duration::from_secs(1));
                rss_kib = rss_kib.max(status_kib(pid, "VmRSS")?);
            }
            let ticks = cpu_ticks(pid)? - ticks_before;
            let window = start.elapsed();
            let passes_after = pass_totals(agent)?;
            let passes = passes_after.1 - passes_before.1;
            ensure!(passes > 0.0, "the agent timed no reconcile pass in {window:?}");
            let events_after = events(agent)?;
            if events_after != events_before {
                println!("agent idle: {} allocations and frees during the window, measuring again", events_after - events_before);
                continue;
            }
            // SAFETY: sysconf has no preconditions.
            let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
            let processes = std::fs::read_dir("/proc")?.flatten().filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok()).count();
            return Ok(Idle {
                rss_kib,
                hwm_kib: status_kib(pid, "VmHWM")?,
                anon_kib: status_kib(pid, "RssAnon")?,
                file_kib: status_kib(pid, "RssFile")?,
                shmem_kib: status_kib(pid, "RssShmem")?,
                ticks,
                hz,
                window,
                cpu_percent: ticks as f64 / hz / window.as_secs_f64() * 100.0,
                processes,
                passes,
                pass_mean_ms: (passes_after.0 - passes_before.0) / passes * 1e3,
            });
        }
        bail!("allocations or frees in each of {WINDOW_TRIES} idle windows: something else runs workloads on the fake driver; run the benchmark alone")
    }
}

/// Exit to slot freed, one holder at a time, seen from the ledger and by the agent.
struct Reclaimed {
    /// Exit (the holder's clock just before it SIGKILLs itself) to slot freed, and the
    /// agent's own figures (exit event to slot freed), in ms, sorted.
    seen: Vec<f64>,
    logged: Vec<f64>,
    /// Reclaims the agent made on exit events (the rest: its 1 s sweep).
    from_events: usize,
    histogram: Histogram,
}

impl Reclaimed {
    /// Starts a [`victim`] in each ledger of `paths`, [`BATCH`] at a time, and lets them die
    /// one at a time, each once the previous one's slot is free; fails if a slot is not freed
    /// within [`NEVER`] or the agent did not log and count every reclaim.
    fn measure(agent: &Agent, node: &FakeNode, paths: &[PathBuf]) -> Result<Reclaimed> {
        let mut seen = Vec::with_capacity(VICTIMS);
        let mut pids = Vec::with_capacity(VICTIMS);
        let stamps = TempDir::new("bench-exit-stamps")?;
        for (round, batch) in paths[..VICTIMS].chunks(BATCH).enumerate() {
            let stamp = |i: usize| stamps.path().join(format!("{}", round * BATCH + i));
            let victims: Vec<(&Path, Running)> =
                batch.iter().enumerate().map(|(i, path)| Ok((path.as_path(), victim(node, path, &stamp(i))?))).collect::<Result<_>>()?;
            recorded(agent, &victims)?;
            for (i, (path, mut victim)) in victims.into_iter().enumerate() {
                let pid = victim.pid();
                let mut live = ledgers::slot_watch(path, pid)?;
                ensure!(live()?, "the slot of process {pid} in {} is not live before the kill", path.display());
                let start = Instant::now();
                let prompt = Prompt::now();
                victim.resume()?;
                let freed = loop {
                    if !live()? {
                        break monotonic_ns();
                    }
                    if start.elapsed() > NEVER {
                        bail!(
                            "the slot of process {pid} (killed) in {} not freed within {NEVER:?}; agent log: {}",
                            path.display(),
                            agent.log()
                        );
                    }
                    std::thread::sleep(POLL);
                };
                drop(prompt);
                let stamp = stamp(i);
                let said = std::fs::read_to_string(&stamp).with_context(|| format!("reading {}", stamp.display()))?;
                let exited: u64 = said.parse().with_context(|| format!("process {pid} wrote {said:?}"))?;
                drop(victim); // reaped now
                ensure!(freed >= exited, "process {pid} read its clock ({exited} ns) after its slot was found free ({freed} ns)");
                seen.push((freed - exited) as f64 / 1e6);
                pids.push(pid);
                std::thread::sleep(GAP);
            }
        }
        let (mut logged, from_events) = logged_latencies(&agent.log(), &pids)?;
        let histogram = Histogram::of(&scrape(agent.metrics_addr()?)?, "vramguard_reclaim_latency_seconds")?;
        // (Beside a hostile ledger the agent may count that ledger's reclaims too.)
        ensure!(histogram.count >= VICTIMS as u64, "the agent's histogram counted {} reclaims, fewer than {VICTIMS}", histogram.count);
        seen.sort_by(f64::total_cmp);
        logged.sort_by(f64::total_cmp);
        println!(
            "reclaim: exit to slot freed p50 {:.2} ms, p99 {:.2} ms; the agent's figure p50 {:.2} ms, p99 {:.2} ms",
            percentile(&seen, 0.50),
            percentile(&seen, 0.99),
            percentile(&logged, 0.50),
            percentile(&logged, 0.99)
        );
        Ok(Reclaimed { seen, logged, from_events, histogram })
    }

    /// p50 and p99 of both figures, against the 1 s requirement and the p99 target.
    fn rows(&self, rows: &mut Vec<Row>, beside: &str) {
        let seen = format!("exit to slot freed in the ledger, {VICTIMS} holders killing themselves one at a time{beside}");
        let logged = format!("the agent's own figure, exit event to slot freed{beside}");
        for (what, samples) in [(seen.as_str(), &self.seen), (logged.as_str(), &self.logged)] {
            for (name, quantile) in [("p50", 0.50), ("p99", 0.99)] {
                let figure = percentile(samples, quantile);
                let (target, label) = reclaim_target(name);
                rows.push(Row::target(format!("exit-to-reclaim {name}: {what}"), figure, "ms", 2, target, label));
            }
        }
    }

    fn note(&self) -> String {
        format!(
            "Exit-to-reclaim: a new holder in each of the {LEDGERS} ledgers, {BATCH} at a time, beside the others; each \
             one's slot had its host pid recorded by the agent before it was let past its checkpoint, to read \
             CLOCK_MONOTONIC, say it and SIGKILL itself (the exit itself: no wake-up of a sleeping process comes \
             first, as it would after a kill(2) from outside); the time runs from that reading to the first read of \
             the slot (one pread every {} us, without the ledger's lock) that finds it free; the killed process stays an \
             unreaped zombie until then. Slowest: {:.2} ms. The agent's own figure is the `latency_us=` of its \
             \"reclaimed the slot of a process that is gone\" line, from the time the kernel gave its exit event (in \
             do_exit, before the process's teardown); {} of the {VICTIMS} reclaims came from exit events (any other: from its 1 s sweep). \
             Its histogram `vramguard_reclaim_latency_seconds` counted {} reclaims, mean {:.2} ms, 99% within the \
             bucket bound le={} s. The baseline is the issue's requirement, 1 s. Percentiles are nearest-rank.",
            POLL.as_micros(),
            self.seen.last().copied().unwrap_or(f64::NAN),
            self.from_events,
            self.histogram.count,
            self.histogram.mean() * 1e3,
            self.histogram.bound(0.99),
        )
    }
}

/// The agent's latency in ms of each victim's reclaim, from its log, and how many came from
/// exit events; fails unless every victim's reclaim is there.
fn logged_latencies(log: &str, pids: &[u32]) -> Result<(Vec<f64>, usize)> {
    let mut latencies = Vec::with_capacity(pids.len());
    let mut from_events = 0;
    for &pid in pids {
        let line = log
            .lines()
            .find(|line| line.contains("reclaimed the slot of a process that is gone") && e2e::field(line, "host_pid").ok() == Some(u64::from(pid)))
            .with_context(|| format!("the agent logged no reclaim of process {pid}: {log}"))?;
        latencies.push(e2e::field(line, "latency_us")? as f64 / 1e3);
        from_events += usize::from(line.contains("from_exit_event=true"));
    }
    Ok((latencies, from_events))
}

/// A histogram of the agent's, as a scrape gives it.
struct Histogram {
    count: u64,
    sum: f64,
    /// (bucket bound `le`, observations up to it), by bound.
    buckets: Vec<(f64, f64)>,
}

impl Histogram {
    /// The histogram `name` (seconds) of a scrape.
    fn of(all: &[Sample], name: &str) -> Result<Histogram> {
        let count = single(all, &format!("{name}_count"))? as u64;
        let sum = single(all, &format!("{name}_sum"))?;
        let mut buckets: Vec<(f64, f64)> = samples(all, &format!("{name}_bucket"))
            .map(|s| Ok((s.label("le").replace("+Inf", "inf").parse::<f64>().with_context(|| format!("bad le in {name}"))?, s.value)))
            .collect::<Result<_>>()?;
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        Ok(Histogram { count, sum, buckets })
    }

    /// What was observed since `before` (a scrape of the same histogram).
    fn since(&self, before: &Histogram) -> Histogram {
        let buckets = self
            .buckets
            .iter()
            .map(|(le, n)| (*le, n - before.buckets.iter().find(|(b, _)| b == le).map_or(0.0, |(_, n)| *n)))
            .collect();
        Histogram { count: self.count.saturating_sub(before.count), sum: self.sum - before.sum, buckets }
    }

    fn mean(&self) -> f64 {
        self.sum / self.count as f64
    }

    /// Count, mean, p50 and p99 in ms, for the console.
    fn summary(&self) -> String {
        format!("{} observed, mean {:.3} ms, p50 {:.3} ms, p99 {:.3} ms", self.count, self.mean() * 1e3, self.quantile(0.50) * 1e3, self.quantile(0.99) * 1e3)
    }

    /// The least bucket bound (`le`) holding the fraction `q` of the observations.
    fn bound(&self, q: f64) -> String {
        self.buckets
            .iter()
            .find(|(_, cumulative)| *cumulative >= q * self.count as f64)
            .map(|(le, _)| le.to_string())
            .unwrap_or_else(|| "?".into())
    }

    /// The `q` quantile, interpolated linearly within the bucket that holds it (as
    /// Prometheus's `histogram_quantile`; the largest finite bound if it lies past them).
    fn quantile(&self, q: f64) -> f64 {
        let rank = q * self.count as f64;
        let (mut lower, mut below) = (0.0, 0.0);
        for &(le, cumulative) in &self.buckets {
            if cumulative >= rank {
                if le.is_infinite() {
                    return lower;
                }
                let within = cumulative - below;
                return if within > 0.0 { lower + (le - lower) * (rank - below) / within } else { lower };
            }
            (lower, below) = (le, cumulative);
        }
        f64::NAN
    }
}

/// The nearest-rank `p` quantile of `samples`, sorted.
fn percentile(samples: &[f64], p: f64) -> f64 {
    let rank = (p * samples.len() as f64).ceil() as usize;
    samples.get(rank.clamp(1, samples.len().max(1)) - 1).copied().unwrap_or(f64::NAN)
}

/// The value of the metric `name` (its first sample).
fn single(all: &[Sample], name: &str) -> Result<f64> {
    samples(all, name).next().map(|s| s.value).with_context(|| format!("no {name} in the scrape"))
}

/// Allocation and free events the agent's probes have seen.
/// (sum in seconds, count) of the agent's `vramguard_reconcile_pass_seconds`.
fn pass_totals(agent: &Agent) -> Result<(f64, f64)> {
    let all = scrape(agent.metrics_addr()?)?;
    Ok((single(&all, "vramguard_reconcile_pass_seconds_sum")?, single(&all, "vramguard_reconcile_pass_seconds_count")?))
}

fn events(agent: &Agent) -> Result<u64> {
    let audit = agent.audit()?;
    Ok(Agent::stat(&audit, "events_alloc").saturating_add(Agent::stat(&audit, "events_free")))
}

/// utime + stime of process `pid`, in clock ticks.
fn cpu_ticks(pid: u32) -> Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).with_context(|| format!("the agent (pid {pid}) is gone"))?;
    let after = stat.rfind(')').map(|i| &stat[i + 1..]).context("unreadable stat")?;
    // Fields 14 and 15 (utime, stime), counted after the command name (which ends field 2).
    let fields: Vec<&str> = after.split_whitespace().collect();
    let tick = |index: usize| fields.get(index).and_then(|f| f.parse::<u64>().ok()).context("no utime/stime in stat");
    Ok(tick(11)? + tick(12)?)
}

/// A `kB` line of /proc/<pid>/status.
fn status_kib(pid: u32, key: &str) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).with_context(|| format!("the agent (pid {pid}) is gone"))?;
    status
        .lines()
        .find_map(|line| line.strip_prefix(key)?.strip_prefix(':')?.trim().strip_suffix("kB")?.trim().parse().ok())
        .with_context(|| format!("no {key} in /proc/{pid}/status"))
}

/// A hostile container's ledger: the largest geometry the agent allows by default (4096
/// slots, 262,144 records), every slot naming a dead process (work for the reclaimer, all of
/// it under the lock), and a process of the benchmark's own (a thread here) keeping its
/// `dirty` flag raised and its lock's owner and list words rewritten, so every locked
/// operation on it repairs the whole ledger first. Removed on drop.
struct Hostile {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    scribbler: Option<std::thread::JoinHandle<()>>,
    dir: PathBuf,
}

impl Hostile {
    const SLOTS: u32 = 4096;
    const RECORDS: u32 = 1 << 18;

    fn plant(root: &Path) -> Result<Hostile> {
        use std::os::unix::fs::{FileExt, MetadataExt};
        let dir = root.join("zz-hostile");
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("ledger");
        ledgers::create(&path, Self::SLOTS, Self::RECORDS, 64 * GIB, CONTEXT)?;
        let pidns = std::fs::metadata("/proc/self/ns/pid")?.ino();
        let ledger = ledger::Ledger::open(&path)?;
        for pid in 0..Self::SLOTS {
            ledger.register(ledger::ProcessIdentity { pid: 4_000_000 + pid, pidns, start_time: 1 })?;
        }
        drop(ledger);
        let file = std::fs::OpenOptions::new().write(true).open(&path)?;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let running = stop.clone();
        let scribbler = std::thread::spawn(move || {
            let state = ledger::layout::PAGE;
            let dirty = state + std::mem::offset_of!(ledger::layout::State, dirty) as u64;
            let mut word = 0x4141_4141_4141_4141u64;
            while !running.load(std::sync::atomic::Ordering::Relaxed) {
                word = word.rotate_left(9) ^ 0x9e37_79b9_7f4a_7c15;
                let _ = file.write_all_at(&(word as u32).to_ne_bytes(), state + 8);
                let _ = file.write_all_at(&word.to_ne_bytes(), state + 24);
                let _ = file.write_all_at(&1u32.to_ne_bytes(), dirty);
                std::thread::sleep(Duration::from_micros(200));
            }
        });
        Ok(Hostile { stop, scribbler: Some(scribbler), dir })
    }
}

impl Drop for Hostile {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(scribbler) = self.scribbler.take() {
            let _ = scribbler.join();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
