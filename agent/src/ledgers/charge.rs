//! The agent's charges in the ledgers: GPU memory a hooked container holds outside its
//! ledger (what [`crate::reconcile::Reconciler::unaccounted_by_ledger`] finds: processes of
//! the container that skip the preload, processes that wrote their own charge down) is
//! charged to the ledger, so the hooks of the container's other processes see it and refuse
//! what would pass the quota.
//!
//! The agent holds one slot of its own in each ledger it charges (registered with its own
//! process identity) and one record in it, replaced with [`ledger::Ledger::recharge`] at every pass
//! (so a charge follows the amount, grows back once the quota has room, and is made again if
//! a workload freed it), and dropped when the amount falls to zero. Over quota the charge is
//! cut to what the quota still holds. The probes cannot tell devices apart, so the charge goes to the
//! ledger's first device. On a clean stop the agent frees its slots; if it dies, its slot is
//! a dead process's like any other, and the next agent reclaims it.
//!
//! Every charge is a worker call under the ledger's lock, which a workload can hold: the
//! charges run on a thread of their own ([`Charging`]), which takes the latest amounts a pass
//! wanted, so no pass waits for a ledger's lock or worker (a pass used to wait up to the lock
//! wait of each ledger owed a charge whose lock a workload held).
use std::{
    collections::{BTreeMap, BTreeSet},
    sync::{Arc, Condvar, Mutex},
    thread::JoinHandle,
};

use ledger::{ProcessIdentity, RecordId, SlotId};
use tracing::{info, warn};

use crate::{
    identity,
    ledgers::{worker::Failure, AccessError, LedgerHandle, Ledgers},
};

/// The device the agent charges (see the module doc).
const DEVICE: u32 = 0;

/// The agent's charge in one ledger.
#[derive(Clone, Copy, Debug, Default)]
struct Held {
    slot: Option<SlotId>,
    record: Option<RecordId>,
    /// What the ledger holds (less than asked when the quota is full).
    charged: u64,
}

pub struct Charger {
    /// The agent's identity; `None` (charging off) if it could not be read.
    agent: Option<ProcessIdentity>,
    /// By ledger path.
    held: BTreeMap<String, Held>,
    /// The error the last attempt on each ledger met, while it lasts.
    failing: BTreeMap<String, String>,
}

impl Charger {
    /// A charger; off (charging nothing) unless the agent runs in the host's pid namespace:
    /// elsewhere its slot, were it to die, could be freed by no one (the hooks leave the slots
    /// of other namespaces alone, and so would the next agent there), and the charge would
    /// hold the container's quota for good.
    pub fn new() -> Charger {
        if !identity::in_initial_pid_namespace() {
            warn!("this agent does not run in the host's pid namespace (hostPID): memory held outside a ledger is not charged to it");
            return Charger { agent: None, held: BTreeMap::new(), failing: BTreeMap::new() };
        }
        let agent = match ProcessIdentity::current() {
            Ok(agent) => Some(agent),
            Err(error) => {
                warn!(%error, "cannot read the agent's own process identity: unaccounted memory will not be charged to ledgers");
                None
            }
        };
        Charger { agent, held: BTreeMap::new(), failing: BTreeMap::new() }
    }

    /// Brings every watched ledger's charge to `wanted` (bytes by ledger path; a ledger not
    /// in it wants none), but for the `unreadable` ones, whose charges stay as they are.
    pub fn update(&mut self, ledgers: &Ledgers, wanted: &BTreeMap<String, u64>, unreadable: &BTreeSet<String>) {
        let Some(agent) = self.agent else { return };
        let watched: BTreeMap<String, &LedgerHandle> = ledgers.iter().map(|(path, l)| (path.display().to_string(), l)).collect();
        // A ledger no longer watched: its file is gone or replaced, and the charge with it.
        self.held.retain(|path, _| watched.contains_key(path));
        self.failing.retain(|path, _| watched.contains_key(path));
        for (path, ledger) in watched {
            if unreadable.contains(&path) {
                continue;
            }
            let bytes = wanted.get(&path).copied().unwrap_or(0);
            let held = self.held.get(&path).copied().unwrap_or_default();
            // A charge is asserted again at every update (not only when the amount changes): a
            // charge cut to the quota grows back as room frees up, and one a workload freed
            // behind the agent's back is made again.
            if bytes == 0 && held.record.is_none() {
                continue;
            }
            match charge(ledger, agent, held, bytes) {
                Ok(now) => {
                    if now.charged != held.charged {
                        info!(ledger = %path, wanted = bytes, charged = now.charged, "charged the container's memory held outside its ledger");
                    }
                    self.failing.remove(&path);
                    self.held.insert(path, now);
                }
                // Left alone for a while (its lock stayed held, its worker failed): said when
                // that happened; the charge stays as it was.
                Err(AccessError::Backoff { .. }) => {}
                Err(error) => {
                    // Logged when it starts or changes, not at every pass it lasts.
                    let text = error.to_string();
                    if self.failing.get(&path) != Some(&text) {
                        warn!(ledger = %path, %error, "cannot charge the container's memory held outside its ledger");
                        self.failing.insert(path.clone(), text);
                    }
                    self.held.remove(&path);
                }
            }
        }
    }

    /// Bytes charged, by ledger path (ledgers charged nothing are left out).
    pub fn charged(&self) -> BTreeMap<&str, u64> {
        self.held.iter().filter(|(_, h)| h.charged > 0).map(|(path, h)| (path.as_str(), h.charged)).collect()
    }

    /// Frees the agent's slots (on a clean stop).
    pub fn release_all(&mut self, ledgers: &Ledgers) {
        let Some(agent) = self.agent else { return };
        for (path, ledger) in ledgers.iter() {
            let Some(held) = self.held.remove(&path.display().to_string()) else { continue };
            if let Some(slot) = held.slot {
                if let Err(error) = ledger.reclaim_process(slot, agent) {
                    warn!(ledger = %path.display(), %error, "cannot free the agent's slot");
                }
            }
        }
    }
}

/// Frees every slot of the agent's own in the watched ledgers, whoever took it: the reclaim
/// task's last act at a stop, so that the charges go with the agent even when the reconcile
/// task (whose [`Charger`] knows them) died or was stopped before it could free them. Returns
/// how many were freed.
pub fn release_own(ledgers: &Ledgers) -> usize {
    if !identity::in_initial_pid_namespace() {
        return 0; // the agent charges nothing there (Charger::new)
    }
    let Ok(agent) = ProcessIdentity::current() else { return 0 };
    let mut freed = 0;
    for (path, ledger) in ledgers.iter() {
        let Ok(slots) = ledger.slots() else { continue };
        for view in slots.iter().filter(|view| view.slot.process() == agent) {
            match ledger.reclaim_process(view.id, agent) {
                Ok(_) => freed += 1,
                Err(error) => warn!(ledger = %path.display(), %error, "cannot free the agent's slot"),
            }
        }
    }
    freed
}

/// The [`Charger`] on a thread of its own: a pass hands it the amounts it wants
/// ([`Charging::submit`], the latest replacing any not started yet) and reads what is charged
/// ([`Charging::charged`]) without waiting for a worker.
pub struct Charging {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<Charger>>,
}

struct Shared {
    job: Mutex<Job>,
    bell: Condvar,
    /// Bytes charged, by ledger path, as of the last update made.
    charged: Mutex<BTreeMap<String, u64>>,
}

enum Job {
    Idle,
    Update { ledgers: Arc<Ledgers>, wanted: BTreeMap<String, u64>, unreadable: BTreeSet<String> },
    Stop,
}

impl Charging {
    /// Starts the thread.
    pub fn start(charger: Charger) -> std::io::Result<Charging> {
        let shared = Arc::new(Shared { job: Mutex::new(Job::Idle), bell: Condvar::new(), charged: Mutex::new(BTreeMap::new()) });
        let theirs = shared.clone();
        let thread = std::thread::Builder::new().name("vramguard-charge".into()).spawn(move || {
            let mut charger = charger;
            loop {
                let job = {
                    let Ok(mut job) = theirs.job.lock() else { return charger };
                    while matches!(*job, Job::Idle) {
                        job = match theirs.bell.wait(job) {
                            Ok(job) => job,
                            Err(_) => return charger,
                        };
                    }
                    std::mem::replace(&mut *job, Job::Idle)
                };
                match job {
                    Job::Update { ledgers, wanted, unreadable } => {
                        charger.update(&ledgers, &wanted, &unreadable);
                        let now = charger.charged().into_iter().map(|(path, bytes)| (path.to_owned(), bytes)).collect();
                        if let Ok(mut charged) = theirs.charged.lock() {
                            *charged = now;
                        }
                    }
                    Job::Stop => return charger,
                    Job::Idle => {}
                }
            }
        })?;
        Ok(Charging { shared, thread: Some(thread) })
    }

    /// Hands the thread the charges a pass wants (see [`Charger::update`]); never waits for it.
    /// An error if the thread ended (a panic: the task cannot go on without it).
    pub fn submit(&self, ledgers: Arc<Ledgers>, wanted: BTreeMap<String, u64>, unreadable: BTreeSet<String>) -> Result<(), String> {
        if self.thread.as_ref().is_none_or(JoinHandle::is_finished) {
            return Err("the charging thread ended".into());
        }
        let mut job = self.shared.job.lock().map_err(|_| "the charging thread's job was poisoned".to_string())?;
        *job = Job::Update { ledgers, wanted, unreadable };
        self.shared.bell.notify_one();
        Ok(())
    }

    /// Bytes charged, by ledger path, as of the last update the thread made.
    pub fn charged(&self) -> BTreeMap<String, u64> {
        self.shared.charged.lock().map(|charged| charged.clone()).unwrap_or_default()
    }

    /// Stops the thread once the update it is making is done (an update not started is
    /// dropped), then frees the agent's slots in `ledgers` (blocking: worker calls).
    pub fn release_all(mut self, ledgers: &Ledgers) {
        if let Ok(mut job) = self.shared.job.lock() {
            *job = Job::Stop;
            self.shared.bell.notify_one();
        }
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(mut charger)) => charger.release_all(ledgers),
            // Its charges go with the agent's slots, freed by the reclaim task's stop.
            _ => warn!("the charging thread ended early: the agent's slots are freed by the reclaim task's stop"),
        }
    }
}

impl Default for Charger {
    fn default() -> Charger {
        Charger::new()
    }
}

/// Makes the agent's charge in `ledger` `bytes`, registering its slot first if it has none
/// (or lost it: a slot freed by someone who judged the agent dead).
fn charge(ledger: &LedgerHandle, agent: ProcessIdentity, held: Held, bytes: u64) -> Result<Held, AccessError> {
    let slot = match held.slot {
        Some(slot) => slot,
        None if bytes == 0 => return Ok(Held::default()),
        None => ledger.register(agent)?,
    };
    let (record, charged) = match ledger.recharge(slot, agent, DEVICE, held.record, bytes) {
        Err(AccessError::Refused(Failure::UnknownSlot(_))) => {
            let slot = ledger.register(agent)?;
            let (record, charged) = ledger.recharge(slot, agent, DEVICE, None, bytes)?;
            return Ok(Held { slot: Some(slot), record, charged });
        }
        other => other?,
    };
    Ok(Held { slot: Some(slot), record, charged })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ledger::{layout::CREATOR_AGENT, Charge, DeviceConfig, Geometry, Ledger};

    const MIB: u64 = 1 << 20;

    #[test]
    fn charges_follow_the_unaccounted_memory_and_go_with_the_agent() {
        let dir = std::env::temp_dir().join(format!("vramguard-charge-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("pod")).expect("mkdir");
        let geometry = Geometry {
            slots: 4,
            records: 64,
            devices: vec![DeviceConfig { limit: 64 * MIB, chunk: 2 * MIB, ..Default::default() }],
        };
        let path = dir.join("pod/ledger");
        let ledger = Ledger::create(&path, &geometry, CREATOR_AGENT).expect("create");
        let worker = ledger.register(ProcessIdentity { pid: 7, pidns: 1, start_time: 1 }).expect("register");
        ledger.reserve(worker, 0, Charge::Device(16 * MIB), 0x1000).expect("reserve");
        let mut ledgers = Ledgers::new(dir.clone());
        ledgers.scan();
        let name = path.display().to_string();
        let used = || ledger.device_usage().expect("usage")[0].used_chunks * 2 * MIB;

        let mut charger = Charger::new();
        charger.update(&ledgers, &BTreeMap::from([(name.clone(), 20 * MIB)]), &BTreeSet::new());
        assert_eq!(used(), 36 * MIB);
        assert_eq!(charger.charged(), BTreeMap::from([(name.as_str(), 20 * MIB)]));
        assert_eq!(ledger.slots().expect("slots").len(), 2, "one slot of the agent's own");
        // More than the quota holds: cut to it, and the worker is refused.
        charger.update(&ledgers, &BTreeMap::from([(name.clone(), 100 * MIB)]), &BTreeSet::new());
        assert_eq!(used(), 64 * MIB);
        assert!(ledger.reserve(worker, 0, Charge::Device(2 * MIB), 0x2000).is_err());
        assert_eq!(charger.charged(), BTreeMap::from([(name.as_str(), 48 * MIB)]));
        // The worker frees its 16 MiB: the same amount asked again grows the cut charge back.
        let worker_record = ledger.records().expect("records").into_iter().find(|(_, r)| r.slot == worker).expect("record").0;
        ledger.release(worker, worker_record).expect("release");
        charger.update(&ledgers, &BTreeMap::from([(name.clone(), 100 * MIB)]), &BTreeSet::new());
        assert_eq!(charger.charged(), BTreeMap::from([(name.as_str(), 64 * MIB)]));
        assert_eq!(used(), 64 * MIB);
        // Someone freed the agent's slot (and the worker is gone too): it takes a new one.
        let own = ledger.slots().expect("slots").into_iter().find(|v| v.id != worker).expect("agent slot").id;
        ledger.reclaim(own).expect("reclaim");
        ledger.reclaim(worker).expect("reclaim the worker");
        charger.update(&ledgers, &BTreeMap::from([(name.clone(), 10 * MIB)]), &BTreeSet::new());
        assert_eq!(used(), 10 * MIB);
        // The same amount again after someone freed it: made again.
        ledger.reclaim(ledger.slots().expect("slots").into_iter().next().expect("agent slot").id).expect("reclaim");
        assert_eq!(used(), 0);
        charger.update(&ledgers, &BTreeMap::from([(name.clone(), 10 * MIB)]), &BTreeSet::new());
        assert_eq!(used(), 10 * MIB);
        // A ledger the pass could not read keeps its charge as it is.
        charger.update(&ledgers, &BTreeMap::new(), &BTreeSet::from([name.clone()]));
        assert_eq!(used(), 10 * MIB);
        // Nothing unaccounted: nothing charged.
        charger.update(&ledgers, &BTreeMap::new(), &BTreeSet::new());
        assert_eq!(used(), 0);
        assert!(charger.charged().is_empty());
        // A clean stop frees the slot.
        charger.update(&ledgers, &BTreeMap::from([(name.clone(), 4 * MIB)]), &BTreeSet::new());
        charger.release_all(&ledgers);
        assert_eq!(used(), 0);
        assert_eq!(ledger.slots().expect("slots").len(), 0);
        assert_eq!(ledger.check().expect("check"), Vec::<String>::new());
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
