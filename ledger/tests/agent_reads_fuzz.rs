//! Fuzz-style test of the node agent's ways into a ledger (issue "Hostile tenants": the agent
//! trusts nothing a workload can write): random damage anywhere in the file, the robust
//! mutex's bytes included, applied while another thread keeps rewriting the lock's words
//! (owner, robust-list pointers) and the `dirty` flag, as a hostile workload would, and while
//! the agent's operations run on the file:
//!
//! * [`ledger::copy::read`] (every pass): never panics, never reads past the slot table the
//!   validated header gives, and fails only with `Truncated` or `Io`;
//! * [`ledger::file::write_host_pid`]: writes inside the slot table or refuses;
//! * [`Ledger::private_copy`] (`vramguard inspect`): runs the ledger's own code, lock
//!   included, on a private copy with a fresh lock, so a wedged or poisoned lock in the file
//!   neither hangs nor reaches it; `check()` and `slots()` return without panicking.
//!
//! The operations that take the file's own lock run in the agent's confined worker
//! processes; the end-to-end suite (`tests/e2e/tests/hostile_ledger.rs`) attacks those.
use std::{
    fs::{File, OpenOptions},
    mem::offset_of,
    os::unix::fs::FileExt,
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
};

use ledger::{
    copy,
    layout::{State, CREATOR_AGENT, PAGE},
    Charge, DeviceConfig, Geometry, Ledger, LedgerError, ProcessIdentity,
};
use proptest::prelude::*;

const MIB: u64 = 1 << 20;

struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A populated ledger file of its own; its validated header.
fn populated() -> (TempFile, ledger::layout::Header) {
    use std::sync::atomic::AtomicU64;
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let path = std::env::temp_dir().join(format!("ledger-agent-fuzz-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed)));
    let _ = std::fs::remove_file(&path);
    let geometry = Geometry { slots: 16, records: 128, devices: vec![DeviceConfig { limit: 256 * MIB, chunk: 2 * MIB, context_reserve: 8 * MIB, ..Default::default() }] };
    let ledger = Ledger::create(&path, &geometry, CREATOR_AGENT).expect("create");
    for who in 0..6 {
        let slot = ledger.register(ProcessIdentity { pid: 100 + who, pidns: 3, start_time: 50 + u64::from(who) }).expect("register");
        ledger.reserve(slot, 0, Charge::Context, 0).expect("context");
        let _ = ledger.reserve(slot, 0, Charge::Device(3 * MIB + u64::from(who)), 0x1000);
        let _ = ledger.reserve(slot, 0, Charge::Device(4096), 0x2000);
    }
    let header = *ledger.header();
    (TempFile(path), header)
}

#[derive(Clone, Debug)]
enum Damage {
    /// Bytes written at a fraction (1/65536ths) of the file, anywhere, the lock included.
    Bytes { at: u32, bytes: Vec<u8> },
    /// A word planted in the lock's 64 bytes.
    LockWord { at: u8, value: u64 },
    /// The file cut at a fraction of its length.
    Truncate { at: u32 },
    /// The file grown.
    Extend { by: u16 },
}

fn damage() -> impl Strategy<Value = Damage> {
    prop_oneof![
        4 => (any::<u32>(), prop::collection::vec(any::<u8>(), 1..64)).prop_map(|(at, bytes)| Damage::Bytes { at, bytes }),
        3 => (0u8..8, any::<u64>()).prop_map(|(at, value)| Damage::LockWord { at, value }),
        1 => any::<u32>().prop_map(|at| Damage::Truncate { at }),
        1 => (1u16..).prop_map(|by| Damage::Extend { by }),
    ]
}

fn apply(file: &File, size: u64, damage: &Damage) {
    match damage {
        Damage::Bytes { at, bytes } => {
            let at = (u64::from(*at & 0xffff) * size) >> 16;
            let len = (bytes.len() as u64).min(size - at) as usize;
            file.write_all_at(&bytes[..len], at).expect("write");
        }
        Damage::LockWord { at, value } => file.write_all_at(&value.to_ne_bytes(), PAGE + u64::from(*at) * 8).expect("write"),
        Damage::Truncate { at } => file.set_len((u64::from(*at & 0xffff) * size) >> 16).expect("truncate"),
        Damage::Extend { by } => file.set_len(size + u64::from(*by)).expect("extend"),
    }
}

/// Keeps rewriting the lock's owner and list words and the dirty flag until stopped.
fn scribbler(path: PathBuf, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let Ok(file) = OpenOptions::new().write(true).open(&path) else { return };
        let dirty = PAGE + offset_of!(State, dirty) as u64;
        let mut value = 0x4141_4141_4141_4141u64;
        while !stop.load(Ordering::Relaxed) {
            value = value.rotate_left(7) ^ 0x9e37_79b9_7f4a_7c15;
            let _ = file.write_all_at(&(value as u32).to_ne_bytes(), PAGE + 8);
            let _ = file.write_all_at(&value.to_ne_bytes(), PAGE + 24);
            let _ = file.write_all_at(&(!value).to_ne_bytes(), PAGE + 32);
            let _ = file.write_all_at(&1u32.to_ne_bytes(), dirty);
        }
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn the_agents_reads_survive_any_damage_and_a_hostile_lock(damages in prop::collection::vec(damage(), 1..6)) {
        let (file, header) = populated();
        let stop = Arc::new(AtomicBool::new(false));
        let scribbling = scribbler(file.0.clone(), stop.clone());
        let handle = OpenOptions::new().read(true).write(true).open(&file.0).expect("open");
        let size = header.total_size;
        for damage in &damages {
            apply(&handle, size, damage);
            for _ in 0..20 {
                match copy::read(&handle, &header, &file.0) {
                    Ok(copy) => {
                        let live = copy.live_slots();
                        prop_assert!(live.len() <= header.slot_count as usize);
                        prop_assert!(live.iter().all(|v| v.id < header.slot_count));
                        prop_assert_eq!(copy.devices.len(), header.device_count as usize);
                        for view in &live {
                            let _ = ledger::file::write_host_pid(&handle, &header, view.id, 4242);
                        }
                    }
                    Err(LedgerError::Truncated { .. } | LedgerError::Io { .. }) => {}
                    Err(other) => prop_assert!(false, "unexpected error {other}"),
                }
            }
            prop_assert!(ledger::file::write_host_pid(&handle, &header, header.slot_count, 1).is_err());
            // inspect's private copy: a fresh lock, so the hostile one can neither wedge nor
            // reach it; a damaged header is refused with a typed error.
            if let Ok(ledger) = Ledger::private_copy(&handle, &file.0, 64 * MIB) {
                let _ = ledger.check();
                let _ = ledger.slots();
                let _ = ledger.records();
            }
        }
        stop.store(true, Ordering::Relaxed);
        scribbling.join().expect("scribbler");
    }
}

#[test]
fn a_copy_is_unsettled_while_the_dirty_flag_is_held_and_settled_after() {
    let (file, header) = populated();
    let handle = OpenOptions::new().read(true).write(true).open(&file.0).expect("open");
    let dirty = PAGE + offset_of!(State, dirty) as u64;
    handle.write_all_at(&1u32.to_ne_bytes(), dirty).expect("raise");
    let held = copy::read(&handle, &header, &file.0).expect("copy");
    assert!(!held.settled);
    assert_eq!(held.live_slots().len(), 6, "still read");
    handle.write_all_at(&0u32.to_ne_bytes(), dirty).expect("lower");
    assert!(copy::read(&handle, &header, &file.0).expect("copy").settled);
}
