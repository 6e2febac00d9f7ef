//! Chaos test of the ledger (issue 3, "Must show"): 16 real processes hammer one ledger
//! file with random reserves and releases for 10 s while a chaos loop SIGKILLs random ones
//! (about half of the kills aimed at a worker that just announced it is about to sit in the
//! lock for 2 to 10 ms, so they land inside it) and starts replacements. Meanwhile the
//! parent sweeps dead slots every second, as the agent does, and a monitor thread reads the
//! per-device usage (under the lock, and raw from the file without it) continuously.
//!
//! Workers are this test binary run again (`--exact chaos_worker`, with
//! `LEDGER_CHAOS_WORKER` naming the ledger); without that variable the worker test returns
//! at once. Each worker times every ledger call and reads the repair counter after every
//! operation: a window of calls in which the counter moved is one in which some process
//! found a dead holder (or a dirty ledger) and repaired, and the longest call of such a
//! window bounds what this survivor waited on a lock whose holder was dead. Workers report
//! over stdout, line by line; at the end the living ones stop, report exactly what they
//! hold, and wait to be told to exit.
//!
//! Asserted: (a) no survivor waited 100 ms or more on a lock whose holder was dead; (b)
//! `check()` finds nothing at the end; (c) after reclaiming the dead, each device's usage is
//! the sum of what the living report holding, slot by slot; (d) repairs happened (kills did
//! land inside the lock); (e) the monitor never saw usage above the limit; and no worker
//! failed on its own. The figures print with `--nocapture`.
use std::{
    collections::{HashMap, HashSet},
    io::{BufRead, BufReader, Read, Write},
    mem::offset_of,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, Stdio},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    thread,
    time::{Duration, Instant},
};

use ledger::{
    layout::{State, CREATOR_AGENT, PAGE},
    Charge, DeviceConfig, Geometry, Kind, Ledger, ProcessIdentity, RecordId, ReserveError,
};

const WORKER_ENV: &str = "LEDGER_CHAOS_WORKER";
const WORKER_TEST: &str = "chaos_worker";
const WORKERS: usize = 16;
const CHAOS: Duration = Duration::from_secs(10);
const MIB: u64 = 1 << 20;
const CHUNK: u64 = 2 * MIB;
/// Per device: limit in chunks, context reserve in bytes.
const DEVICES: [(u64, u64); 2] = [(192, 3 * MIB), (96, MIB)];
/// Most live allocations a worker keeps.
const MAX_LIVE: usize = 24;
/// The bound of issue 3 on waiting for a dead holder's lock.
const DEAD_OWNER_WAIT_LIMIT: Duration = Duration::from_millis(100);

/// xorshift64*: enough randomness for choosing actions.
struct Rng(u64);

impl Rng {
    fn seeded(extra: u64) -> Rng {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
        Rng((nanos ^ extra.rotate_left(32) ^ 0x9e37_79b9_7f4a_7c15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo)
    }
}

// ---- the worker (a child process) ----

#[test]
fn chaos_worker() {
    // In a normal run this is a no-op: `sixteen_processes_killed_at_random` runs the chaos
    // and asserts; it starts this test in child processes with the variable set.
    if let Ok(path) = std::env::var(WORKER_ENV) {
        worker(Path::new(&path));
    }
}

/// What a worker holds on one device, by the accounting rules.
#[derive(Default, Clone, Copy)]
struct Holding {
    /// Chunks of allocations of a chunk or more, and of managed memory.
    whole: u64,
    /// Live bytes of allocations under a chunk (packed).
    small: u64,
    /// Chunks of the context reserve, once held.
    context: Option<u64>,
}

impl Holding {
    fn chunks(&self) -> u64 {
        self.whole + self.small.div_ceil(CHUNK) + self.context.unwrap_or(0)
    }
}

/// Times ledger calls and keeps the figures the parent collects.
struct Waits {
    /// Repair counter as last read (None before the first read).
    repairs: Option<u64>,
    /// Longest call in the current window (since the last read of the counter).
    window: Duration,
    /// Longest call of a window in which the repair counter moved.
    repair_max: Duration,
    /// Longest call overall.
    any_max: Duration,
    /// Windows in which the counter moved.
    repair_windows: u64,
}

impl Waits {
    fn new() -> Waits {
        Waits { repairs: None, window: Duration::ZERO, repair_max: Duration::ZERO, any_max: Duration::ZERO, repair_windows: 0 }
    }

    /// Runs `f`, counting `held` (time the call spends holding the lock on purpose) out.
    fn time<R>(&mut self, held: Duration, f: impl FnOnce() -> R) -> R {
        let start = Instant::now();
        let result = f();
        self.window = self.window.max(start.elapsed().saturating_sub(held));
        result
    }

    /// Closes a window by reading the repair counter (itself a timed call in the window).
    fn close(&mut self, ledger: &Ledger) {
        let repairs = self.time(Duration::ZERO, || ledger.repairs()).expect("repairs");
        // The first window has no earlier reading: count it as a repair window (an
        // over-estimate, never an under-estimate).
        if self.repairs != Some(repairs) {
            self.repair_max = self.repair_max.max(self.window);
            self.repair_windows += 1;
        }
        self.any_max = self.any_max.max(self.window);
        self.repairs = Some(repairs);
        self.window = Duration::ZERO;
    }

    fn line(&self) -> String {
        format!(
            "repair_us={} any_us={} windows={}",
            self.repair_max.as_micros(),
            self.any_max.as_micros(),
            self.repair_windows
        )
    }
}

fn worker(path: &Path) {
    let pid = std::process::id();
    let mut rng = Rng::seeded(u64::from(pid));
    let ledger = Ledger::open(path).expect("worker: open the ledger");
    let devices = ledger.header().device_count;
    assert_eq!(ledger.header().devices[0].chunk, CHUNK);

    // stdin: "stop" ends the work; end of file ends the process.
    let (stop, exit) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
    {
        let (stop, exit) = (stop.clone(), exit.clone());
        thread::spawn(move || {
            for line in std::io::stdin().lock().lines() {
                match line.as_deref() {
                    Ok("stop") => stop.store(true, Ordering::SeqCst),
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
            stop.store(true, Ordering::SeqCst);
            exit.store(true, Ordering::SeqCst);
        });
    }

    let mut waits = Waits::new();
    waits.close(&ledger);
    let me = ProcessIdentity::current().expect("own identity");
    let slot = waits.time(Duration::ZERO, || ledger.register(me)).expect("worker: register");
    waits.close(&ledger);
    println!("CHAOS READY slot={slot}");

    let mut holding = vec![Holding::default(); devices as usize];
    let mut live: Vec<(RecordId, u32, Kind, u64)> = Vec::new();
    let (mut ops, mut refusals) = (0u64, 0u64);
    let mut reported = (Duration::ZERO, Duration::ZERO);
    while !stop.load(Ordering::SeqCst) {
        let roll = rng.below(1000);
        let device = rng.below(u64::from(devices)) as u32;
        if roll < 3 {
            // Sit in the lock, announced so the chaos loop can kill us there.
            let hold = Duration::from_millis(rng.range(2, 11));
            println!("CHAOS HOLD");
            waits.time(hold, || ledger.hold_lock_for(hold)).expect("hold the lock");
        } else if holding[device as usize].context.is_none() && (roll < 60 || ops == 0) {
            let reserve = DEVICES[device as usize].1;
            match waits.time(Duration::ZERO, || ledger.reserve(slot, device, Charge::Context, 0)) {
                Ok(_) => holding[device as usize].context = Some(reserve.div_ceil(CHUNK)),
                Err(ReserveError::OverQuota { .. }) => refusals += 1,
                Err(error) => panic!("worker: context on device {device}: {error}"),
            }
        } else if live.is_empty() || (live.len() < MAX_LIVE && roll < 600) {
            let (charge, kind, bytes) = match rng.below(10) {
                0..=4 => {
                    let bytes = rng.range(1, CHUNK);
                    (Charge::Device(bytes), Kind::Small, bytes)
                }
                5..=7 => {
                    let bytes = rng.range(CHUNK, 4 * CHUNK + 1);
                    (Charge::Device(bytes), Kind::Data, bytes)
                }
                _ => {
                    let bytes = rng.range(1, 2 * CHUNK + 1);
                    (Charge::Managed(bytes), Kind::Managed, bytes)
                }
            };
            match waits.time(Duration::ZERO, || ledger.reserve(slot, device, charge, ops)) {
                Ok(record) => {
                    live.push((record, device, kind, bytes));
                    let h = &mut holding[device as usize];
                    match kind {
                        Kind::Small => h.small += bytes,
                        _ => h.whole += bytes.div_ceil(CHUNK),
                    }
                }
                Err(ReserveError::OverQuota { .. }) => refusals += 1,
                Err(error) => panic!("worker: reserve {charge:?} on device {device}: {error}"),
            }
        } else {
            let (record, device, kind, bytes) = live.swap_remove(rng.below(live.len() as u64) as usize);
            waits.time(Duration::ZERO, || ledger.release(slot, record)).expect("worker: release");
            let h = &mut holding[device as usize];
            match kind {
                Kind::Small => h.small -= bytes,
                _ => h.whole -= bytes.div_ceil(CHUNK),
            }
        }
        ops += 1;
        waits.close(&ledger);
        if (waits.repair_max, waits.any_max) != reported {
            reported = (waits.repair_max, waits.any_max);
            println!("CHAOS WAIT {}", waits.line());
        }
        thread::sleep(Duration::from_micros(rng.below(3000)));
    }
    let held: Vec<String> = holding.iter().map(|h| h.chunks().to_string()).collect();
    println!("CHAOS FINAL slot={slot} held={} ops={ops} refusals={refusals} {}", held.join(","), waits.line());
    while !exit.load(Ordering::SeqCst) {
        thread::sleep(Duration::from_millis(1));
    }
}

// ---- the parent ----

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What the parent learns from a worker's lines.
#[derive(Default)]
struct Report {
    repair_us: u64,
    any_us: u64,
    windows: u64,
    /// From the FINAL line: slot, chunks held per device, ops, refusals.
    last: Option<(u32, Vec<u64>, u64, u64)>,
}

struct Shared {
    /// When each worker last announced it is about to hold the lock.
    holds: Mutex<HashMap<u32, Instant>>,
    reports: Mutex<HashMap<u32, Report>>,
    stderr: Mutex<HashMap<u32, String>>,
}

struct Worker {
    child: Child,
    stdin: Option<ChildStdin>,
}

fn field<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    line.split_whitespace().find_map(|word| word.strip_prefix(name)?.strip_prefix('='))
}

fn take_report(shared: &Shared, pid: u32, line: &str) {
    let mut reports = shared.reports.lock().unwrap();
    let report = reports.entry(pid).or_default();
    let number = |name| field(line, name).and_then(|v| v.parse::<u64>().ok());
    if let (Some(r), Some(a), Some(w)) = (number("repair_us"), number("any_us"), number("windows")) {
        report.repair_us = report.repair_us.max(r);
        report.any_us = report.any_us.max(a);
        report.windows = report.windows.max(w);
    }
    if line.starts_with("CHAOS FINAL") {
        let held = field(line, "held").unwrap().split(',').map(|v| v.parse().unwrap()).collect();
        report.last = Some((number("slot").unwrap() as u32, held, number("ops").unwrap(), number("refusals").unwrap()));
    }
}

fn spawn(exe: &Path, ledger: &Path, shared: &Arc<Shared>) -> Worker {
    let mut child = Command::new(exe)
        .args(["--exact", WORKER_TEST, "--nocapture", "--test-threads", "1"])
        .env(WORKER_ENV, ledger)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start a worker");
    let pid = child.id();
    let stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let s = shared.clone();
    thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if line == "CHAOS HOLD" {
                s.holds.lock().unwrap().insert(pid, Instant::now());
            } else if line.starts_with("CHAOS ") {
                take_report(&s, pid, &line);
            }
        }
    });
    let s = shared.clone();
    thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        s.stderr.lock().unwrap().insert(pid, text);
    });
    let stdin = child.stdin.take();
    Worker { child, stdin }
}

/// Reads device usage continuously, under the lock and raw from the file, and counts any
/// sample above a limit.
struct Monitor {
    samples: u64,
    over_limit: Vec<String>,
    max_used: Vec<u64>,
    waits: Waits,
}

fn monitor(path: PathBuf, done: Arc<AtomicBool>) -> Monitor {
    let ledger = Ledger::open(&path).expect("monitor: open");
    let file = std::fs::File::open(&path).unwrap();
    let limits: Vec<u64> = (0..DEVICES.len()).map(|d| ledger.header().devices[d].chunks).collect();
    let mut m = Monitor { samples: 0, over_limit: Vec::new(), max_used: vec![0; limits.len()], waits: Waits::new() };
    let mut raw = [0u8; 8];
    while !done.load(Ordering::SeqCst) {
        let usage = m.waits.time(Duration::ZERO, || ledger.device_usage()).expect("monitor: usage");
        m.waits.close(&ledger);
        for (d, &limit) in limits.iter().enumerate() {
            // Unlocked: what any reader of the mapping could see at any instant.
            let at = PAGE + offset_of!(State, devices) as u64 + d as u64 * size_of::<ledger::layout::DeviceUsage>() as u64;
            file.read_exact_at(&mut raw, at).unwrap();
            let unlocked = u64::from_ne_bytes(raw);
            for (how, used) in [("locked", usage[d].used_chunks), ("unlocked", unlocked)] {
                m.max_used[d] = m.max_used[d].max(used);
                if used > limit {
                    m.over_limit.push(format!("device {d}: {used} of {limit} chunks ({how} read)"));
                }
            }
        }
        m.samples += 1;
        thread::sleep(Duration::from_micros(200));
    }
    m
}

#[test]
fn sixteen_processes_killed_at_random() {
    if std::env::var_os(WORKER_ENV).is_some() {
        return;
    }
    let dir = TempDir(std::env::temp_dir().join(format!("ledger-chaos-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&dir.0);
    std::fs::create_dir_all(&dir.0).unwrap();
    let path = dir.0.join("ledger");
    let geometry = Geometry {
        slots: 128,
        records: 8192,
        devices: DEVICES
            .iter()
            .map(|&(chunks, context_reserve)| DeviceConfig { limit: chunks * CHUNK, chunk: CHUNK, context_reserve, ..Default::default() })
            .collect(),
    };
    let ledger = Ledger::create(&path, &geometry, CREATOR_AGENT).unwrap();
    let exe = std::env::current_exe().unwrap();
    let shared = Arc::new(Shared { holds: Default::default(), reports: Default::default(), stderr: Default::default() });

    let done = Arc::new(AtomicBool::new(false));
    let monitor = {
        let (path, done) = (path.clone(), done.clone());
        thread::spawn(move || monitor(path, done))
    };

    let mut workers: HashMap<u32, Worker> = HashMap::new();
    for _ in 0..WORKERS {
        let w = spawn(&exe, &path, &shared);
        workers.insert(w.child.id(), w);
    }
    let mut rng = Rng::seeded(u64::from(std::process::id()));
    let (mut kills, mut aimed, mut swept) = (0u64, 0u64, 0usize);
    let mut failed: Vec<String> = Vec::new();
    let start = Instant::now();
    let mut next_kill = start + Duration::from_millis(rng.range(20, 60));
    let mut aim_until: Option<Instant> = None;
    let mut next_sweep = start + Duration::from_secs(1);
    while start.elapsed() < CHAOS {
        let now = Instant::now();
        if now >= next_kill {
            // Half the kills wait (up to 40 ms) for a worker that just announced a hold.
            let aim = *aim_until.get_or_insert_with(|| if rng.below(2) == 0 { now + Duration::from_millis(40) } else { now });
            let holder = {
                let holds = shared.holds.lock().unwrap();
                holds.iter().filter(|(pid, at)| workers.contains_key(pid) && at.elapsed() < Duration::from_millis(2)).map(|(pid, _)| *pid).next()
            };
            let victim = match holder {
                Some(pid) => {
                    aimed += 1;
                    Some(pid)
                }
                None if now >= aim => {
                    let pids: Vec<u32> = workers.keys().copied().collect();
                    Some(pids[rng.below(pids.len() as u64) as usize])
                }
                None => None,
            };
            if let Some(pid) = victim {
                let mut w = workers.remove(&pid).unwrap();
                // A worker that already exited on its own failed.
                if let Ok(Some(status)) = w.child.try_wait() {
                    failed.push(format!("worker {pid} exited on its own: {status}"));
                }
                let _ = w.child.kill();
                let _ = w.child.wait(); // reaped: its pid is gone, reclaim_dead can tell
                kills += 1;
                let fresh = spawn(&exe, &path, &shared);
                workers.insert(fresh.child.id(), fresh);
                next_kill = Instant::now() + Duration::from_millis(rng.range(20, 60));
                aim_until = None;
            }
        }
        if now >= next_sweep {
            swept += ledger.reclaim_dead().expect("sweep").len();
            next_sweep += Duration::from_secs(1);
        }
        thread::sleep(Duration::from_micros(300));
    }

    // Stop the living; each reports exactly what it holds and waits.
    for w in workers.values_mut() {
        let _ = writeln!(w.stdin.as_mut().unwrap(), "stop");
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let reported = {
            let reports = shared.reports.lock().unwrap();
            workers.keys().filter(|pid| reports.get(pid).is_some_and(|r| r.last.is_some())).count()
        };
        if reported == workers.len() {
            break;
        }
        for (pid, w) in workers.iter_mut() {
            if let Ok(Some(status)) = w.child.try_wait() {
                let stderr = shared.stderr.lock().unwrap().get(pid).cloned().unwrap_or_default();
                panic!("worker {pid} exited before its final report: {status}\n{stderr}");
            }
        }
        assert!(Instant::now() < deadline, "only {reported} of {} workers reported their holdings", workers.len());
        thread::sleep(Duration::from_millis(5));
    }
    done.store(true, Ordering::SeqCst);
    let monitor = monitor.join().expect("monitor thread");

    // (b) sound, before and after reclaiming the dead.
    let problems = ledger.check().unwrap();
    assert!(problems.is_empty(), "check() after the chaos: {problems:#?}");
    let reclaimed = ledger.reclaim_dead().unwrap();
    let problems = ledger.check().unwrap();
    assert!(problems.is_empty(), "check() after reclaiming the dead: {problems:#?}");

    // (c) usage is exactly what the living hold, device by device and slot by slot.
    let finals: Vec<(u32, Vec<u64>, u64, u64)> = {
        let reports = shared.reports.lock().unwrap();
        workers.keys().map(|pid| reports[pid].last.clone().unwrap()).collect()
    };
    let usage = ledger.device_usage().unwrap();
    for (d, u) in usage.iter().enumerate() {
        let living: u64 = finals.iter().map(|f| f.1[d]).sum();
        assert_eq!(u.used_chunks, living, "device {d}: usage after reclaiming the dead vs what the living hold");
    }
    let slots = ledger.slots().unwrap();
    let live_slots: HashSet<u32> = slots.iter().map(|v| v.id).collect();
    let worker_slots: HashSet<u32> = finals.iter().map(|f| f.0).collect();
    assert_eq!(live_slots, worker_slots, "live slots after reclaiming the dead are exactly the living workers'");
    for (slot, held, _, _) in &finals {
        let view = slots.iter().find(|v| v.id == *slot).unwrap();
        for (d, &want) in held.iter().enumerate() {
            let have: u64 = view.slot.devices[d].chunks.iter().sum();
            assert_eq!(have, want, "slot {slot} device {d}: the ledger charges {have} chunks, the worker holds {want}");
        }
    }

    // Let the living go; none may have failed.
    for (pid, mut w) in workers.drain() {
        drop(w.stdin.take());
        let status = w.child.wait().unwrap();
        if !status.success() {
            let stderr = shared.stderr.lock().unwrap().get(&pid).cloned().unwrap_or_default();
            failed.push(format!("worker {pid}: {status}\n{stderr}"));
        }
    }
    assert!(failed.is_empty(), "workers failed: {failed:#?}");

    let repairs = ledger.repairs().unwrap();
    let (mut worst, mut worst_any, mut windows, mut ops, mut refusals) = (0u64, 0u64, 0u64, 0u64, 0u64);
    for report in shared.reports.lock().unwrap().values() {
        worst = worst.max(report.repair_us);
        worst_any = worst_any.max(report.any_us);
        windows += report.windows;
        if let Some(last) = &report.last {
            ops += last.2;
            refusals += last.3;
        }
    }
    worst = worst.max(monitor.waits.repair_max.as_micros() as u64);
    worst_any = worst_any.max(monitor.waits.any_max.as_micros() as u64);
    println!(
        "chaos: {:.1} s, {kills} kills ({aimed} aimed at a worker holding the lock), {repairs} repairs, \
         {swept} dead slots swept during the run and {} at the end; the 16 living at the end made {ops} operations ({refusals} refused)",
        start.elapsed().as_secs_f64(),
        reclaimed.len()
    );
    println!(
        "chaos: longest call in a window with a repair (dead-owner wait bound) {:.2} ms over {windows} windows \
         (monitor {:.2} ms); longest call overall {:.2} ms",
        worst as f64 / 1000.0,
        monitor.waits.repair_max.as_secs_f64() * 1000.0,
        worst_any as f64 / 1000.0
    );
    println!(
        "chaos: monitor {} samples, max used {:?} of limits {:?} chunks, {} over the limit",
        monitor.samples,
        monitor.max_used,
        DEVICES.iter().map(|d| d.0).collect::<Vec<_>>(),
        monitor.over_limit.len()
    );

    // (e) never above the limit.
    assert!(monitor.over_limit.is_empty(), "usage above the limit: {:#?}", monitor.over_limit);
    // (d) kills landed inside the lock.
    assert!(repairs > 0, "no repair in {kills} kills: no kill landed inside the lock");
    // (a) no survivor waited long on a dead holder.
    assert!(
        Duration::from_micros(worst) < DEAD_OWNER_WAIT_LIMIT,
        "a survivor waited {worst} us in a window with a repair (limit {DEAD_OWNER_WAIT_LIMIT:?})"
    );
    assert!(kills >= 100, "only {kills} kills");
}
