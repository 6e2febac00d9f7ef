//! The adversarial suite, many tenants at once (issue 17, "No tenant can stall, starve or fill
//! the node through the agent"): 50 hostile ledgers beside a healthy container, each with its
//! lock held by a live process for the whole test, a slot of a process that does not exist
//! (the reclaimer owes it a reclaim, which needs the lock; the holder's `dirty` flag written
//! down, so that the agent's copies settle and it goes for the lock), and, in ten of them, a hooked
//! process that wrote its own charge down (the agent owes the ledger a charge, which needs the
//! lock too). While they are there, the healthy container's killed processes are reclaimed
//! within a second, `/healthz` on the health listener answers within 250 ms every 100 ms, and
//! every hostile ledger is reported, with the reason, in `vramguard audit` and in
//! `vramguard_ledgers_backed_off`. The negative control runs the same scene without the
//! hostile ledgers. Needs root; run with `cargo xtask test`.
use std::{
    ffi::OsStr,
    os::unix::fs::FileExt,
    path::PathBuf,
    sync::{Arc, Barrier},
    thread::JoinHandle,
    time::Duration,
};

use anyhow::{ensure, Context, Result};
use e2e::{
    agent::Agent,
    holding,
    hostile::{assert_serving, Bystander, HealthProbe},
    http, ledgers, wait_for, FakeNode, Running, TempDir, GIB, MIB,
};
use ledger::{Ledger, ProcessIdentity};

/// Hostile ledgers in the attack.
const HOSTILE: usize = 50;
/// Of them, those with a process that wrote its own charge down (a charge owed).
const OWED: usize = 10;
/// How long the holders keep the hostile ledgers' locks (longer than the test's attack).
const HELD_FOR: Duration = Duration::from_secs(40);

/// The hostile ledgers: their lock holders (threads of this test, alive throughout), and the
/// hooked processes of those owed a charge.
struct Hostile {
    paths: Vec<PathBuf>,
    holders: Vec<JoinHandle<()>>,
    processes: Vec<Running>,
}

impl Hostile {
    /// The ledgers, made before the agent starts (so that it watches them from the start).
    fn make(dir: &TempDir, count: usize) -> Result<Hostile> {
        let paths = (0..count)
            .map(|i| {
                let path = dir.ledger(&format!("hostile-{i:02}"))?;
                ledgers::create(&path, 16, 256, GIB, 64 * MIB)?;
                Ok(path)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Hostile { paths, holders: Vec::new(), processes: Vec::new() })
    }

    /// The attack, once the agent runs (so that its probes see the hooked processes allocate).
    fn attack(&mut self) -> Result<()> {
        let node = FakeNode::new("hostile-many").with_env("FAKECUDA_CONTEXT_BYTES", "64m");
        let pidns = std::fs::metadata("/proc/self/ns/pid").map(|m| std::os::unix::fs::MetadataExt::ino(&m))?;
        for (i, path) in self.paths.iter().enumerate() {
            if i < OWED {
                // A hooked process that allocates, then writes its charge down: tampered, and
                // the agent owes its ledger what the probes see beyond the charge.
                let running = holding(node.hooked(path, GIB)?, &["ctx 0", "alloc a 128m"])?;
                ledgers::zero_slot_bytes(path, running.pid())?;
                self.processes.push(running);
            }
            // A slot no process has: dead, owed a reclaim (made after the hooks started: a
            // hook frees the dead slots of its own pid namespace when it opens the ledger).
            Ledger::open(path)?.register(ProcessIdentity { pid: 4_100_000 + i as u32, pidns, start_time: 1 })?;
        }
        // Every lock taken and held (by a live process: this one) until well after the
        // test's checks; the `dirty` flag the holder raised is then written down through the
        // file, as a tenant would, so that the agent's copies settle and it goes for the lock
        // (a ledger left dirty is only reported unsettled).
        let dirty = ledger::layout::PAGE + std::mem::offset_of!(ledger::layout::State, dirty) as u64;
        let taken = Arc::new(Barrier::new(self.paths.len() + 1));
        self.holders = self
            .paths
            .iter()
            .map(|path| {
                let ledger = Ledger::open(path)?;
                let file = std::fs::OpenOptions::new().write(true).open(path)?;
                let taken = taken.clone();
                Ok(std::thread::spawn(move || {
                    let holding = std::thread::spawn(move || ledger.hold_lock_for(HELD_FOR));
                    std::thread::sleep(Duration::from_millis(200));
                    let _ = file.write_all_at(&0u32.to_ne_bytes(), dirty);
                    taken.wait();
                    let _ = holding.join();
                }))
            })
            .collect::<Result<Vec<_>>>()?;
        taken.wait();
        Ok(())
    }
}

/// The scene with `hostile` hostile ledgers (0: the negative control).
fn scene(hostile: usize) -> Result<()> {
    let dir = TempDir::new(if hostile > 0 { "hostile-many" } else { "hostile-many-control" })?;
    let mut attack = Hostile::make(&dir, hostile)?;
    let agent = Agent::watching(dir.path(), &[OsStr::new("--health-addr"), OsStr::new("127.0.0.1:0")])?;
    let health = agent.health_addr()?;
    let probe = HealthProbe::start(health, Duration::from_millis(100));
    attack.attack()?;
    let node = FakeNode::new("hostile-many-bystander");
    let mut bystander = Bystander::start(&node, &dir, &agent)?;

    // Every hostile ledger found, and reported with the reason: its lock stays held (the
    // reclaim of its dead slot, and the charge it is owed, are refused by its lock).
    let names: Vec<String> = attack.paths.iter().map(|p| p.display().to_string()).collect();
    wait_for(Duration::from_secs(20), "every hostile ledger reported as backed off", || {
        let audit = agent.audit()?;
        let problems = &audit["ledger_problems"];
        Ok(names.iter().all(|name| problems[name.as_str()].as_str().is_some_and(|p| p.contains("lock stayed held"))))
    })
    .with_context(|| format!("audit: {}\nlog:\n{}", agent.audit().map(|a| a["ledger_problems"].to_string()).unwrap_or_default(), agent.log()))?;
    // The processes that wrote their charge down are found out (the charge the agent then
    // owes their ledgers is what their locks refuse).
    let owed: Vec<u32> = attack.processes.iter().map(Running::pid).collect();
    wait_for(Duration::from_secs(10), "the processes that wrote their charge down reported tampered", || {
        let audit = agent.audit()?;
        let rows = audit["processes"].as_array().cloned().unwrap_or_default();
        Ok(owed.iter().all(|pid| rows.iter().any(|row| row["pid"].as_u64() == Some(u64::from(*pid)) && row["state"] == "tampered")))
    })?;
    let backed_off = http::metric(&http::fresh_scrape(agent.metrics_addr()?)?, "vramguard_ledgers_backed_off", &[]).unwrap_or(-1.0);
    ensure!(backed_off >= hostile as f64, "vramguard_ledgers_backed_off is {backed_off}, {hostile} hostile ledgers");
    if hostile == 0 {
        ensure!(agent.audit()?["ledger_problems"].as_object().is_none_or(|p| p.is_empty()), "problems without an attack");
    }

    // Meanwhile the other tenant's processes are reclaimed within a second, each time.
    for _ in 0..3 {
        bystander.kill_and_expect_reclaim(&agent)?;
    }
    assert_serving(&agent)?;
    let probes = probe.finish()?;
    ensure!(probes >= 20, "{probes} /healthz probes");
    let log = agent.log();
    ensure!(!log.contains("panicked"), "the agent panicked: {log}");
    // Each hostile ledger's lock was met (and logged) a bounded number of times: backed off,
    // not retried at every pass (about 20 s of the scene: at most a handful per ledger).
    let busy = log.matches("lock stayed held").count();
    ensure!(busy <= hostile * 8, "{busy} lines about held locks for {hostile} ledgers: not backed off");
    agent.stop()?;
    // The holders let go by themselves (after HELD_FOR); the files are gone with `dir`.
    drop(attack.holders);
    Ok(())
}

#[test]
fn fifty_hostile_ledgers_delay_neither_health_nor_other_tenants_reclaims() -> Result<()> {
    scene(HOSTILE)
}

#[test]
fn negative_control_the_same_scene_without_hostile_ledgers() -> Result<()> {
    scene(0)
}
