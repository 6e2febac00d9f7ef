//! The node agent's own costs, against the targets of the issue "The agent": resident memory
//! under 64 MiB and idle CPU under 1% of one core while it watches 100 ledgers, and a killed
//! process's slot freed within 1 s.
//!
//! The agent is the release build, run as the DaemonSet runs it (`--ledger-dir`,
//! `--metrics-addr`, libcuda discovery on) with the fake driver given by `--libcuda`. Its
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
//!   ledgers (20 at a time), each SIGKILLed in turn and left a zombie (as a parent slow to
//!   reap would) while its slot is read in the ledger file every 200 us, without the ledger's
//!   lock, until it is free. The agent's own figure for each, from its exit event's arrival,
//!   comes from its log (`latency_us=`); its histogram (`vramguard_reclaim_latency_seconds`)
//!   must have counted every reclaim.
use std::{
    ffi::OsStr,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};
use e2e::{
    agent::Agent,
    holding,
    http::{samples, scrape, Sample},
    ledgers, wait_for, FakeNode, Running, TempDir, GIB, MIB,
};

use super::Row;

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
/// The targets.
const RSS_TARGET_MIB: f64 = 64.0;
const CPU_TARGET_PERCENT: f64 = 1.0;
/// The target for a reconcile pass, in ms.
const PASS_TARGET_MS: f64 = 10.0;
const RECLAIM_REQUIRED_MS: f64 = 1000.0;

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
    let agent = start(bin, dir.path())?;
    let mut holders = Vec::new();
    for path in &paths[..BUSY_LEDGERS] {
        for _ in 0..HOLDERS_PER_LEDGER {
            holders.push((path.as_path(), holder(&node, path)?));
        }
    }
    recorded(&agent, &holders)?;
    let idle = Idle::measure(&agent)?;
    let reclaimed = Reclaimed::measure(&agent, &node, &paths)?;
    agent.stop()?;
    // A new agent beside the running holders, as after an agent's restart: its probes never
    // saw their allocations.
    let restarted = start(bin, dir.path())?;
    let after_restart = Idle::measure(&restarted)?;
    restarted.stop()?;
    // A third agent, with one hostile ledger beside the others.
    let hostile = Hostile::plant(dir.path())?;
    let beside = start_with_extra(bin, dir.path(), 1)?;
    let hostile_idle = Idle::measure(&beside)?;
    let hostile_reclaimed = Reclaimed::measure(&beside, &node, &paths)?;
    beside.stop()?;
    drop(hostile);
    let held = holders.len();
    drop(holders);

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
        Row::target(
            format!("agent reconcile pass as it runs (eBPF view read, join, charges), mean over the idle window: {setup}"),
            idle.pass_mean_ms,
            "ms",
            3,
            PASS_TARGET_MS,
            "ms, target",
        ),
    ]);
    reclaimed.rows(rows, "");
    rows.push(Row::target(
        format!("agent reconcile pass as it runs, mean over the idle window, one hostile ledger present: {setup}"),
        hostile_idle.pass_mean_ms,
        "ms",
        3,
        PASS_TARGET_MS,
        "ms, target",
    ));
    hostile_reclaimed.rows(rows, ", one hostile ledger present");
    notes.push(format!(
        "The agent: the release build, `vramguard run --libcuda <fake> --ledger-dir DIR --metrics-addr 127.0.0.1:0`, \
         with discovery of libcuda files in running processes on, as the DaemonSet runs it. DIR holds {LEDGERS} \
         container directories with a ledger each, made the agent's way ({SLOTS} slots, {RECORDS} records, a {} GiB \
         quota). The holders are debug builds of the end-to-end kit's hooked `fakecuda-workload` (`ctx 0`, \
         `{HOLDING}`, then asleep): {held}, {HOLDERS_PER_LEDGER} in each of {BUSY_LEDGERS} ledgers, live throughout. \
         The agent is started before them; after the reclaim measurement it is stopped and a new one started beside \
         them (\"restarted\"), whose probes never saw their allocations.",
        LIMIT / GIB,
    ));
    notes.push(format!(
        "Memory and CPU: once the agent had recorded every holder's host pid, {} s to settle, then a window of \
         {:.1} s in which the probes' alloc and free counters did not move (a window in which they did is \
         discarded and measured again, {WINDOW_TRIES} tries at most), with {} processes on the machine. VmRSS from \
         /proc/<pid>/status each second (the most is reported; at the end RssAnon {:.1} MiB, RssFile {:.1} MiB, \
         RssShmem {:.1} MiB: RssFile counts the binary's and the ledgers' mapped pages), VmHWM after it. CPU: \
         utime + stime from /proc/<pid>/stat across the window: {} clock ticks at {} Hz (resolution {:.2}%); the \
         restarted agent: {} ticks over {:.1} s, VmRSS {:.1} MiB. The pass figure is the mean of the agent's own \
         `vramguard_reconcile_pass_seconds` over the {:.0} passes of the window.",
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
        idle.passes,
    ));
    notes.push(reclaimed.note());
    notes.push(format!(
        "One hostile ledger present: a third agent watches the same {LEDGERS} ledgers plus a hostile container's, of \
         the largest geometry the agent allows by default ({} slots, {} records), every slot naming a dead process \
         and a thread of the benchmark keeping its `dirty` flag raised and its lock's owner and list words \
         rewritten (every locked operation on it repairs the whole ledger first). The agent reads it from copies and \
         hands its reclaims to a confined worker, at most {} ms of worker time per sweep. Pass mean {:.3} ms over \
         {:.0} passes; reclaims as above, in the benchmark's ledgers.",
        Hostile::SLOTS,
        Hostile::RECORDS,
        100,
        hostile_idle.pass_mean_ms,
        hostile_idle.passes,
    ));
    Ok(())
}

/// Starts the agent at `bin` on the kit's fake driver, watching `dir`, and waits until it
/// watches every ledger there.
fn start(bin: &Path, dir: &Path) -> Result<Agent> {
    start_with_extra(bin, dir, 0)
}

/// [`start`] where `extra` more ledgers than the benchmark's are under `dir`.
fn start_with_extra(bin: &Path, dir: &Path, extra: usize) -> Result<Agent> {
    let libcuda = e2e::fake_driver_dir()?.join("libcuda.so.1");
    let args = [
        OsStr::new("--libcuda"),
        libcuda.as_os_str(),
        OsStr::new("--ledger-dir"),
        dir.as_os_str(),
        OsStr::new("--metrics-addr"),
        OsStr::new("127.0.0.1:0"),
    ];
    let agent = Agent::start_binary(bin, &args)?;
    let addr = agent.metrics_addr()?;
    wait_for(Duration::from_secs(5), "the agent watches every ledger", || {
        Ok(single(&scrape(addr)?, "vramguard_ledgers")? == (LEDGERS + extra) as f64)
    })
    .with_context(|| format!("agent log: {}", agent.log()))?;
    Ok(agent)
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

/// SIGKILL to slot freed, one holder at a time, seen from the ledger and by the agent.
struct Reclaimed {
    /// Kill to slot freed, and the agent's own figures (exit event to slot freed), in ms,
    /// sorted.
    seen: Vec<f64>,
    logged: Vec<f64>,
    /// Reclaims the agent made on exit events (the rest: its 1 s sweep).
    from_events: usize,
    histogram: Histogram,
}

impl Reclaimed {
    /// Starts a holder in each ledger of `paths`, [`BATCH`] at a time, and SIGKILLs them one
    /// at a time, each once the previous one's slot is free; fails if a slot is not freed
    /// within [`NEVER`] or the agent did not log and count every reclaim.
    fn measure(agent: &Agent, node: &FakeNode, paths: &[PathBuf]) -> Result<Reclaimed> {
        let mut seen = Vec::with_capacity(VICTIMS);
        let mut pids = Vec::with_capacity(VICTIMS);
        for batch in paths[..VICTIMS].chunks(BATCH) {
            let victims: Vec<(&Path, Running)> = batch.iter().map(|path| Ok((path.as_path(), holder(node, path)?))).collect::<Result<_>>()?;
            recorded(agent, &victims)?;
            for (path, victim) in victims {
                let pid = victim.pid();
                let mut live = ledgers::slot_watch(path, pid)?;
                ensure!(live()?, "the slot of process {pid} in {} is not live before the kill", path.display());
                let start = Instant::now();
                victim.signal(libc::SIGKILL)?;
                let freed = loop {
                    if !live()? {
                        break start.elapsed();
                    }
                    if start.elapsed() > NEVER {
                        bail!(
                            "the slot of process {pid} (SIGKILLed) in {} not freed within {NEVER:?}; agent log: {}",
                            path.display(),
                            agent.log()
                        );
                    }
                    std::thread::sleep(POLL);
                };
                drop(victim); // reaped now
                seen.push(freed.as_secs_f64() * 1e3);
                pids.push(pid);
                std::thread::sleep(GAP);
            }
        }
        let (mut logged, from_events) = logged_latencies(&agent.log(), &pids)?;
        let histogram = histogram(&scrape(agent.metrics_addr()?)?)?;
        // (Beside a hostile ledger the agent may count that ledger's reclaims too.)
        ensure!(histogram.count >= VICTIMS as u64, "the agent's histogram counted {} reclaims, fewer than {VICTIMS}", histogram.count);
        seen.sort_by(f64::total_cmp);
        logged.sort_by(f64::total_cmp);
        println!(
            "reclaim: SIGKILL to slot freed p50 {:.2} ms, p99 {:.2} ms; the agent's figure p50 {:.2} ms, p99 {:.2} ms",
            percentile(&seen, 0.50),
            percentile(&seen, 0.99),
            percentile(&logged, 0.50),
            percentile(&logged, 0.99)
        );
        Ok(Reclaimed { seen, logged, from_events, histogram })
    }

    /// p50 and p99 of both figures against the 1 s requirement.
    fn rows(&self, rows: &mut Vec<Row>, beside: &str) {
        let seen = format!("SIGKILL to slot freed in the ledger, {VICTIMS} holders killed one at a time{beside}");
        let logged = format!("the agent's own figure, exit event to slot freed{beside}");
        for (what, samples) in [(seen.as_str(), &self.seen), (logged.as_str(), &self.logged)] {
            for (name, quantile) in [("p50", 0.50), ("p99", 0.99)] {
                let figure = percentile(samples, quantile);
                rows.push(Row::target(format!("exit-to-reclaim {name}: {what}"), figure, "ms", 2, RECLAIM_REQUIRED_MS, "ms, required"));
            }
        }
    }

    fn note(&self) -> String {
        format!(
            "Exit-to-reclaim: a new holder in each of the {LEDGERS} ledgers, {BATCH} at a time, beside the others; each \
             one's slot had its host pid recorded by the agent before the kill; the time runs \
             from just before kill(2) to the first read of the slot (one pread every {} us, without the ledger's lock) \
             that finds it free; the killed process stays an unreaped zombie until then. Slowest: {:.2} ms. The agent's \
             own figure is the `latency_us=` of its \"reclaimed the slot of a process that is gone\" line, from its \
             exit event's arrival; {} of the {VICTIMS} reclaims came from exit events (any other: from its 1 s sweep). \
             Its histogram `vramguard_reclaim_latency_seconds` counted {} reclaims, mean {:.2} ms, 99% within the \
             bucket bound le={} s. The baseline is the issue's requirement, 1 s. Percentiles are nearest-rank.",
            POLL.as_micros(),
            self.seen.last().copied().unwrap_or(f64::NAN),
            self.from_events,
            self.histogram.count,
            self.histogram.sum / self.histogram.count as f64 * 1e3,
            self.histogram.p99_bound,
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

/// `vramguard_reclaim_latency_seconds` of a scrape.
struct Histogram {
    count: u64,
    sum: f64,
    /// The least bucket bound (`le`) holding 99% of the observations.
    p99_bound: String,
}

fn histogram(all: &[Sample]) -> Result<Histogram> {
    let count = single(all, "vramguard_reclaim_latency_seconds_count")? as u64;
    let sum = single(all, "vramguard_reclaim_latency_seconds_sum")?;
    let mut buckets: Vec<(f64, f64)> = samples(all, "vramguard_reclaim_latency_seconds_bucket")
        .map(|s| Ok((s.label("le").replace("+Inf", "inf").parse::<f64>().context("bad le")?, s.value)))
        .collect::<Result<_>>()?;
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let p99_bound = buckets
        .iter()
        .find(|(_, cumulative)| *cumulative >= 0.99 * count as f64)
        .map(|(le, _)| le.to_string())
        .unwrap_or_else(|| "?".into());
    Ok(Histogram { count, sum, p99_bound })
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
