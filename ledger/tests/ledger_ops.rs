//! The ledger's operations on real files: accounting rules, release, reclaim, repair after a
//! holder died mid-update, and refusal of damaged files.
use std::{
    fs::OpenOptions,
    os::unix::fs::FileExt,
    path::PathBuf,
};

use ledger::{
    layout::{CREATOR_AGENT, PAGE},
    Charge, DeviceConfig, Geometry, Ledger, LedgerError, ProcessIdentity, ReserveError,
};

const MIB: u64 = 1 << 20;
const CHUNK: u64 = 2 * MIB;

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("ledger-test-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
    fn file(&self) -> PathBuf {
        self.0.join("ledger")
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn geometry(limit: u64, context: u64) -> Geometry {
    Geometry {
        slots: 8,
        records: 4096,
        devices: vec![DeviceConfig { limit, chunk: CHUNK, context_reserve: context, ..Default::default() }],
    }
}

fn fake_process(pid: u32) -> ProcessIdentity {
    ProcessIdentity { pid, pidns: 1, start_time: 1000 + u64::from(pid) }
}

fn used(ledger: &Ledger) -> u64 {
    ledger.device_usage().unwrap()[0].used_chunks * CHUNK
}

fn assert_sound(ledger: &Ledger) {
    let problems = ledger.check().unwrap();
    assert!(problems.is_empty(), "invariants violated: {problems:#?}");
}

#[test]
fn granularity_matches_the_driver() {
    let dir = TempDir::new("granularity");
    let ledger = Ledger::create(&dir.file(), &geometry(4096 * MIB, 0), CREATOR_AGENT).unwrap();
    // The five H100 figures of docs/design.md ("Platform facts"), each in a process of its own.
    let cases: [(u32, u64, u64, u64); 5] =
        [(1000, 512, 2 * MIB, 1), (200, 64 << 10, 14 * MIB, 2), (200, MIB, 200 * MIB, 3), (100, 2 * MIB, 200 * MIB, 4), (100, 3 * MIB, 400 * MIB, 5)];
    for (count, size, expected, pid) in cases {
        let slot = ledger.register(fake_process(pid as u32)).unwrap();
        let records: Vec<_> =
            (0..count).map(|i| ledger.reserve(slot, 0, Charge::Device(size), u64::from(i)).unwrap()).collect();
        assert_eq!(used(&ledger), expected, "{count} x {size} bytes");
        assert_sound(&ledger);
        for record in records {
            ledger.release(slot, record).unwrap();
        }
        assert_eq!(used(&ledger), 0);
        assert_sound(&ledger);
    }
}

#[test]
fn quota_is_never_exceeded_and_refusals_say_why() {
    let dir = TempDir::new("quota");
    let ledger = Ledger::create(&dir.file(), &geometry(64 * MIB, 6 * MIB), CREATOR_AGENT).unwrap();
    let slot = ledger.register(fake_process(1)).unwrap();
    let context = ledger.reserve(slot, 0, Charge::Context, 0).unwrap();
    assert_eq!(used(&ledger), 6 * MIB);
    // Charged once per process and device.
    assert_eq!(ledger.reserve(slot, 0, Charge::Context, 0).unwrap(), context);
    assert_eq!(used(&ledger), 6 * MIB);
    ledger.reserve(slot, 0, Charge::Device(50 * MIB), 1).unwrap();
    match ledger.reserve(slot, 0, Charge::Device(10 * MIB), 2) {
        Err(ReserveError::OverQuota { device: 0, requested, used, limit }) => {
            assert_eq!((requested, used, limit), (10 * MIB, 56 * MIB, 64 * MIB));
        }
        other => panic!("expected an over-quota refusal, got {other:?}"),
    }
    ledger.reserve(slot, 0, Charge::Managed(8 * MIB), 3).unwrap();
    assert_eq!(used(&ledger), 64 * MIB);
    assert!(matches!(ledger.reserve(slot, 0, Charge::Device(1), 4), Err(ReserveError::OverQuota { .. })));
    assert_sound(&ledger);
    let slots = ledger.slots().unwrap();
    assert_eq!(slots[0].slot.rejections, 2);
}

#[test]
fn every_context_of_a_process_is_charged_and_released_on_its_own() {
    let dir = TempDir::new("contexts");
    let ledger = Ledger::create(&dir.file(), &geometry(48 * MIB, 16 * MIB), CREATOR_AGENT).unwrap();
    let slot = ledger.register(fake_process(1)).unwrap();
    let first = ledger.reserve(slot, 0, Charge::Context, 0).unwrap();
    let second = ledger.reserve(slot, 0, Charge::AnotherContext, 0x5ca2).unwrap();
    let third = ledger.reserve(slot, 0, Charge::AnotherContext, 0x5ca3).unwrap();
    assert!(first != second && second != third);
    assert_eq!(used(&ledger), 48 * MIB);
    assert_sound(&ledger);
    // A repair keeps every context record (none is taken for a duplicate).
    let repairs = ledger.repairs().unwrap();
    assert!(ledger.panic_inside_lock().is_err());
    assert_eq!(used(&ledger), 48 * MIB);
    assert_eq!(ledger.repairs().unwrap(), repairs + 1);
    assert_sound(&ledger);
    // A fourth does not fit in 48 MiB.
    assert!(matches!(ledger.reserve(slot, 0, Charge::AnotherContext, 0), Err(ReserveError::OverQuota { .. })));
    // Released in any order; the process's first context stays linked until it goes.
    ledger.release(slot, second).unwrap();
    assert_eq!(used(&ledger), 32 * MIB);
    assert_eq!(ledger.reserve(slot, 0, Charge::Context, 0).unwrap(), first);
    assert_sound(&ledger);
    ledger.release(slot, first).unwrap();
    assert_eq!(used(&ledger), 16 * MIB);
    assert_sound(&ledger);
    ledger.release(slot, third).unwrap();
    assert_eq!(used(&ledger), 0);
    assert_sound(&ledger);
}

#[test]
fn reclaim_frees_exactly_one_slots_blocks() {
    let dir = TempDir::new("reclaim");
    let ledger = Ledger::create(&dir.file(), &geometry(256 * MIB, 0), CREATOR_AGENT).unwrap();
    let a = ledger.register(fake_process(1)).unwrap();
    let b = ledger.register(fake_process(2)).unwrap();
    for i in 0..10 {
        ledger.reserve(a, 0, Charge::Device(3 * MIB), i).unwrap();
        ledger.reserve(b, 0, Charge::Device(100 << 10), i).unwrap();
    }
    let b_held = used(&ledger) - 40 * MIB;
    assert_eq!(ledger.reclaim(a).unwrap(), 20);
    assert_eq!(used(&ledger), b_held);
    assert!(matches!(ledger.reclaim(a), Err(LedgerError::UnknownSlot(_))));
    assert_sound(&ledger);
}

#[test]
fn host_pid_is_recorded_and_reclaim_process_checks_the_identity() {
    let dir = TempDir::new("reclaim-process");
    let ledger = Ledger::create(&dir.file(), &geometry(256 * MIB, 0), CREATOR_AGENT).unwrap();
    let a = ledger.register(fake_process(1)).unwrap();
    ledger.reserve(a, 0, Charge::Device(4 * MIB), 0).unwrap();
    ledger.set_host_pid(a, 4242);
    ledger.set_host_pid(1 << 20, 1); // out of range: ignored
    let slot = ledger.slots().unwrap()[0].slot;
    assert_eq!(slot.host_pid, 4242);
    // Another process's identity (a reused slot): refused, nothing freed.
    assert_eq!(ledger.reclaim_process(a, fake_process(2)).unwrap(), None);
    assert_eq!(used(&ledger), 4 * MIB);
    assert_eq!(ledger.reclaim_process(a, fake_process(1)).unwrap(), Some(2));
    assert_eq!(used(&ledger), 0);
    // Already free: refused.
    assert_eq!(ledger.reclaim_process(a, fake_process(1)).unwrap(), None);
    // A new process in the freed slot starts without a host pid.
    let b = ledger.register(fake_process(3)).unwrap();
    assert_eq!(b, a);
    assert_eq!(ledger.slots().unwrap()[0].slot.host_pid, 0);
    assert_sound(&ledger);
}

/// A dead process that forked is left to the agent (a child may hold its memory); one that
/// did not is swept.
#[test]
fn reclaim_dead_leaves_the_slots_of_processes_that_forked() {
    let dir = TempDir::new("reclaim-forked");
    let ledger = Ledger::create(&dir.file(), &geometry(256 * MIB, 0), CREATOR_AGENT).unwrap();
    // A process of this pid namespace that is gone: a child, waited for.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    let me = ProcessIdentity::current().unwrap();
    let dead = ProcessIdentity { pid, pidns: me.pidns, start_time: 1 };
    let forked = ledger.register(dead).unwrap();
    ledger.reserve(forked, 0, Charge::Device(4 * MIB), 0).unwrap();
    ledger.mark_forked(forked);
    ledger.mark_forked(1 << 20); // out of range: ignored
    assert_eq!(ledger.slots().unwrap()[0].slot.flags, ledger::layout::SLOT_FORKED);
    assert_eq!(ledger.reclaim_dead().unwrap(), Vec::<u32>::new(), "the forked slot is the agent's to free");
    assert_eq!(used(&ledger), 4 * MIB);
    ledger.reclaim(forked).unwrap();
    let plain = ledger.register(dead).unwrap();
    assert_eq!(ledger.slots().unwrap()[0].slot.flags, 0, "a new slot starts without the flag");
    ledger.reserve(plain, 0, Charge::Device(4 * MIB), 0).unwrap();
    assert_eq!(ledger.reclaim_dead().unwrap(), vec![plain]);
    assert_eq!(used(&ledger), 0);
    assert_sound(&ledger);
}

#[test]
fn a_dirty_ledger_is_rebuilt_from_its_records() {
    let dir = TempDir::new("repair");
    let ledger = Ledger::create(&dir.file(), &geometry(256 * MIB, 4 * MIB), CREATOR_AGENT).unwrap();
    let slot = ledger.register(fake_process(1)).unwrap();
    ledger.reserve(slot, 0, Charge::Context, 0).unwrap();
    ledger.reserve(slot, 0, Charge::Device(5 * MIB), 1).unwrap();
    for i in 0..5 {
        ledger.reserve(slot, 0, Charge::Device(700 << 10), 10 + i).unwrap();
    }
    let before = used(&ledger);
    let repairs = ledger.repairs().unwrap();
    // Scribble over the derived state (usage, buddy words) and mark the ledger dirty, as a
    // holder killed mid-update would leave it.
    let file = OpenOptions::new().write(true).open(dir.file()).unwrap();
    let header = *ledger.header();
    let device = header.devices[0];
    file.write_all_at(&[0xff; 64], device.buddy_offset + 64).unwrap();
    file.write_all_at(&[0xff; 64], device.links_offset).unwrap();
    let dirty_offset = PAGE + 64; // State::dirty follows the 64-byte lock
    file.write_all_at(&1u32.to_ne_bytes(), dirty_offset).unwrap();
    let reopened = Ledger::open(&dir.file()).unwrap();
    assert_eq!(used(&reopened), before);
    assert_eq!(reopened.repairs().unwrap(), repairs + 1);
    assert_sound(&reopened);
}

#[test]
fn damaged_files_are_refused_with_the_reason() {
    let dir = TempDir::new("damaged");
    let path = dir.file();
    Ledger::create(&path, &geometry(64 * MIB, 0), CREATOR_AGENT).unwrap();
    assert!(matches!(Ledger::create(&path, &geometry(64 * MIB, 0), CREATOR_AGENT), Err(LedgerError::AlreadyExists { .. })));
    let pristine = std::fs::read(&path).unwrap();
    let damaged = |edit: &dyn Fn(&mut Vec<u8>)| -> LedgerError {
        let mut bytes = pristine.clone();
        edit(&mut bytes);
        std::fs::write(&path, &bytes).unwrap();
        match Ledger::open(&path) {
            Err(error) => error,
            Ok(_) => panic!("a damaged ledger was accepted"),
        }
    };
    assert!(matches!(damaged(&|b| b[0] = b'X'), LedgerError::NotALedger { .. }));
    assert!(matches!(damaged(&|b| b[8] = 9), LedgerError::Version { found: 9, .. }));
    assert!(matches!(damaged(&|b| b.truncate(b.len() - 4096)), LedgerError::Truncated { .. }));
    assert!(matches!(damaged(&|b| b.truncate(100)), LedgerError::Truncated { .. }));
    // A limit raised by hand: the checksum gives it away.
    let limit_offset = std::mem::offset_of!(ledger::layout::Header, devices) + 16;
    assert!(matches!(damaged(&|b| b[limit_offset + 3] ^= 1), LedgerError::Corrupt { .. }));
    // The buddy space's own header.
    let buddy = Ledger::open_or_create(&dir.0.join("other"), &geometry(64 * MIB, 0), CREATOR_AGENT).unwrap().header().devices[0].buddy_offset as usize;
    let error = damaged(&|b| b[buddy] ^= 0xff);
    assert!(matches!(error, LedgerError::Corrupt { .. }), "{error}");
    assert!(error.to_string().contains("buddy"), "{error}");
    std::fs::write(&path, &pristine).unwrap();
    assert_sound(&Ledger::open(&path).unwrap());
}

#[test]
fn exec_starts_clean_and_slots_run_out_clearly() {
    let dir = TempDir::new("slots");
    let ledger = Ledger::create(&dir.file(), &geometry(64 * MIB, 0), CREATOR_AGENT).unwrap();
    let me = fake_process(1);
    let slot = ledger.register(me).unwrap();
    ledger.reserve(slot, 0, Charge::Device(8 * MIB), 1).unwrap();
    // Same identity again (an exec): the old image's charges are gone.
    assert_eq!(ledger.register(me).unwrap(), slot);
    assert_eq!(used(&ledger), 0);
    for pid in 2..=8 {
        ledger.register(fake_process(pid)).unwrap();
    }
    assert!(matches!(ledger.register(fake_process(9)), Err(LedgerError::NoFreeSlot(8))));
    assert_sound(&ledger);
}

#[test]
fn container_names_are_recorded_once_and_validated() {
    use ledger::{
        layout::{State, NAME_BYTES},
        ContainerNames,
    };
    let dir = TempDir::new("names");
    let ledger = Ledger::create(&dir.file(), &geometry(64 * MIB, 0), CREATOR_AGENT).unwrap();
    assert_eq!(ledger.names(), None, "a new ledger has none");
    assert!(!ledger.set_names(&ContainerNames::default()).unwrap(), "empty names are not written");
    let names = ContainerNames::new("team-a", "trainer-0", "main");
    assert!(ledger.set_names(&names).unwrap());
    assert!(!ledger.set_names(&names).unwrap(), "the same names again: nothing written");
    let other = Ledger::open(&dir.file()).unwrap();
    assert_eq!(other.names(), Some(("team-a".into(), "trainer-0".into(), "main".into())));
    assert!(other.set_names(&ContainerNames::new("team-a", "trainer-1", "main")).unwrap(), "different: the last wins");
    assert_eq!(ledger.names().unwrap().1, "trainer-1");

    // A long pod name is cut at a character boundary within the field.
    let long = format!("{}é{}", "p".repeat(NAME_BYTES - 1), "q".repeat(100));
    ledger.set_names(&ContainerNames::new("ns", &long, "c")).unwrap();
    assert_eq!(ledger.names().unwrap().1, "p".repeat(NAME_BYTES - 1));

    // A control character written by a workload: the names are not handed out.
    let offset = ledger.header().state_offset
        + std::mem::offset_of!(State, names) as u64
        + std::mem::offset_of!(ContainerNames, container) as u64;
    let file = OpenOptions::new().write(true).open(dir.file()).unwrap();
    file.write_all_at(b"evil\n", offset).unwrap();
    assert_eq!(ledger.names(), None);
    file.write_all_at(b"ok\0\0\0", offset).unwrap();
    assert_eq!(ledger.names(), Some(("ns".into(), "p".repeat(NAME_BYTES - 1), "ok".into())));
    assert_sound(&ledger);
}

#[test]
fn recharge_replaces_a_charge_and_cuts_it_to_the_quota() {
    let dir = TempDir::new("recharge");
    let ledger = Ledger::create(&dir.file(), &geometry(64 * MIB, 0), CREATOR_AGENT).unwrap();
    let agent = ledger.register(fake_process(1)).unwrap();
    let worker = ledger.register(fake_process(2)).unwrap();
    ledger.reserve(worker, 0, Charge::Device(16 * MIB), 0x1000).unwrap();

    let (first, charged) = ledger.recharge(agent, fake_process(1), 0, None, 10 * MIB).unwrap();
    assert_eq!(charged, 10 * MIB);
    assert_eq!(used(&ledger), 26 * MIB);
    // Replaced, not added to.
    let (second, charged) = ledger.recharge(agent, fake_process(1), 0, first, 20 * MIB).unwrap();
    assert_eq!(charged, 20 * MIB);
    assert_eq!(used(&ledger), 36 * MIB);
    assert_sound(&ledger);
    // More than the quota holds: cut to the room left, and the quota is full.
    let (third, charged) = ledger.recharge(agent, fake_process(1), 0, second, 100 * MIB).unwrap();
    assert_eq!(charged, 48 * MIB);
    assert_eq!(used(&ledger), 64 * MIB);
    assert!(matches!(ledger.reserve(worker, 0, Charge::Device(CHUNK), 0x2000), Err(ReserveError::OverQuota { .. })));
    assert_sound(&ledger);
    // Down to nothing: the quota is the worker's again.
    assert_eq!(ledger.recharge(agent, fake_process(1), 0, third, 0).unwrap(), (None, 0));
    assert_eq!(used(&ledger), 16 * MIB);
    // A record of another slot is never released in its place.
    let theirs = ledger.reserve(worker, 0, Charge::Device(4 * MIB), 0x3000).unwrap();
    ledger.recharge(agent, fake_process(1), 0, Some(theirs), 2 * MIB).unwrap();
    assert_eq!(used(&ledger), 22 * MIB);
    // A slot that no longer describes the caller's process is not charged.
    assert!(matches!(ledger.recharge(worker, fake_process(1), 0, None, 2 * MIB), Err(LedgerError::UnknownSlot(_))));
    assert_eq!(used(&ledger), 22 * MIB);
    assert_sound(&ledger);
}

#[test]
fn the_header_on_disk_shows_a_rewrite_the_open_copy_does_not() {
    let dir = TempDir::new("header-on-disk");
    let ledger = Ledger::create(&dir.file(), &geometry(64 * MIB, 8 * MIB), CREATOR_AGENT).unwrap();
    let on_disk = || ledger::file::read_header(&std::fs::File::open(dir.file()).unwrap()).unwrap();
    assert_eq!(on_disk().devices, ledger.header().devices);
    let mut rewritten = *ledger.header();
    rewritten.devices[0].context_reserve = 0;
    rewritten.checksum = ledger::layout::fnv1a(ledger::layout::checksummed_bytes(&rewritten));
    // SAFETY: Header is plain #[repr(C)] data.
    let bytes = unsafe { std::slice::from_raw_parts((&rewritten as *const ledger::layout::Header).cast::<u8>(), size_of::<ledger::layout::Header>()) };
    OpenOptions::new().write(true).open(dir.file()).unwrap().write_all_at(bytes, 0).unwrap();
    assert_eq!(on_disk().devices[0].context_reserve, 0);
    assert_eq!(ledger.header().devices[0].context_reserve, 8 * MIB);
    // Consistent with itself, so a new opener accepts it: only a comparison can tell.
    assert_eq!(Ledger::open(&dir.file()).unwrap().header().devices[0].context_reserve, 0);
}

#[test]
fn a_ledger_with_a_lock_timeout_gives_up_on_a_held_lock() {
    let dir = TempDir::new("lock-timeout");
    Ledger::create(&dir.file(), &geometry(64 * MIB, 0), CREATOR_AGENT).unwrap();
    let patient = Ledger::open(&dir.file()).unwrap();
    let hasty = Ledger::open(&dir.file()).unwrap().with_lock_timeout(std::time::Duration::from_millis(50));
    let (held_tx, held_rx) = std::sync::mpsc::channel();
    let holder = std::thread::spawn(move || {
        let holder = Ledger::open(&dir.file()).unwrap();
        held_tx.send(()).unwrap();
        holder.hold_lock_for(std::time::Duration::from_millis(600)).unwrap();
        dir
    });
    held_rx.recv().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(100)); // the holder is inside the lock
    let started = std::time::Instant::now();
    let error = hasty.slots().unwrap_err();
    assert!(matches!(error, LedgerError::Busy { .. }), "{error}");
    assert!(error.to_string().contains("its lock stayed held for 50ms"), "{error}");
    assert!(started.elapsed() < std::time::Duration::from_millis(500), "gave up after its timeout, not the holder's release");
    // Without a timeout: waits for the holder, then works.
    assert!(patient.slots().unwrap().is_empty());
    let _dir = holder.join().unwrap();
    assert!(hasty.slots().unwrap().is_empty());
}

#[test]
fn a_panic_inside_the_lock_is_an_error_and_the_next_holder_repairs() {
    let dir = TempDir::new("panic-inside");
    let ledger = Ledger::create(&dir.file(), &geometry(64 * MIB, 0), CREATOR_AGENT).unwrap();
    let slot = ledger.register(fake_process(1)).unwrap();
    ledger.reserve(slot, 0, Charge::Device(4 * MIB), 0x1000).unwrap();
    let repairs = ledger.repairs().unwrap();
    let error = ledger.panic_inside_lock().unwrap_err();
    assert!(matches!(error, LedgerError::Corrupt { .. }), "{error}");
    // The counter it damaged is rebuilt from the records by the next operation.
    assert_eq!(used(&ledger), 4 * MIB);
    assert_eq!(ledger.repairs().unwrap(), repairs + 1);
    assert_sound(&ledger);
    ledger.reserve(slot, 0, Charge::Device(4 * MIB), 0x2000).unwrap();
    assert_eq!(used(&ledger), 8 * MIB);
}

/// A limit of less than one chunk (a 1-byte quota) is a device with no space: the file is laid
/// out without buddy words or links for it, validates when opened again, and refuses every
/// charge on it (data, small, context) as over quota, while another device of the same ledger
/// admits as usual; the books stay sound.
#[test]
fn a_limit_below_one_chunk_is_a_device_with_no_space() {
    let dir = TempDir::new("no-space");
    let geometry = Geometry {
        slots: 4,
        records: 64,
        devices: vec![
            DeviceConfig { limit: 1, chunk: CHUNK, context_reserve: CHUNK, ..Default::default() },
            DeviceConfig { limit: 4 * MIB, chunk: CHUNK, context_reserve: 0, ..Default::default() },
        ],
    };
    let ledger = Ledger::create(&dir.file(), &geometry, CREATOR_AGENT).unwrap();
    let empty = ledger.header().devices[0];
    assert_eq!((empty.limit, empty.chunks, empty.buddy_words), (0, 0, 0));
    assert_eq!(empty.links_offset, empty.buddy_offset, "no links either");
    let slot = ledger.register(fake_process(1)).unwrap();
    for charge in [Charge::Device(1), Charge::Device(CHUNK), Charge::Managed(3 * MIB), Charge::Context] {
        match ledger.reserve(slot, 0, charge, 0) {
            Err(ReserveError::OverQuota { device: 0, limit: 0, used: 0, .. }) => {}
            other => panic!("{charge:?} on a device with no space: {other:?}"),
        }
    }
    let record = ledger.reserve(slot, 1, Charge::Device(CHUNK), 0).unwrap();
    ledger.reserve(slot, 1, Charge::Device(1), 0).unwrap();
    assert!(ledger.reserve(slot, 1, Charge::Device(1), 0).is_ok(), "packed with the first small one");
    assert_sound(&ledger);
    ledger.release(slot, record).unwrap();
    assert_eq!(ledger.reclaim(slot).unwrap(), 1);
    assert_sound(&ledger);
    drop(ledger);
    let again = Ledger::open(&dir.file()).unwrap();
    assert_eq!(again.header().devices[0].chunks, 0);
    let slot = again.register(fake_process(2)).unwrap();
    assert!(matches!(again.reserve(slot, 0, Charge::Device(1), 0), Err(ReserveError::OverQuota { .. })));
    assert_sound(&again);
}

/// A provisioned ledger's geometry follows its quota and its process bound: slots are the
/// bound; records grow with the quota's chunks (at least the floor, at most the cap); a
/// 1-byte quota makes a file of a few hundred KiB, not the hook's full-size one.
#[test]
fn a_provisioned_geometry_follows_the_quota_and_the_processes() {
    use ledger::layout::{CONTAINER_RECORDS, MIN_RECORDS, RECORDS_PER_CHUNK};
    let tiny = Geometry::provisioned(&[1], CHUNK, 518 * MIB, 128);
    assert_eq!((tiny.slots, u64::from(tiny.records)), (128, MIN_RECORDS + 256));
    let gib = Geometry::provisioned(&[1 << 30, 1 << 30], CHUNK, 518 * MIB, 64);
    assert_eq!(u64::from(gib.records), 1024 * RECORDS_PER_CHUNK + 256 + MIN_RECORDS);
    let huge = Geometry::provisioned(&[80 << 30], CHUNK, 518 * MIB, 128);
    assert_eq!(huge.records, CONTAINER_RECORDS);
    let size = |g: &Geometry| ledger::file::plan(g, CREATOR_AGENT, 0).unwrap().total_size;
    let hook = Geometry { slots: ledger::layout::CONTAINER_SLOTS, records: CONTAINER_RECORDS, ..tiny.clone() };
    eprintln!("1 B: {} bytes, 2 x 1 GiB: {} bytes, 80 GiB: {} bytes, the hook's: {} bytes", size(&tiny), size(&gib), size(&huge), size(&hook));
    assert!(size(&tiny) < 256 << 10, "{}", size(&tiny));
    assert!(size(&tiny) < size(&gib) && size(&gib) < size(&huge));
    assert!(size(&huge) < size(&hook) + (1 << 20));
    let dir = TempDir::new("provisioned-geometry");
    let ledger = Ledger::create(&dir.file(), &tiny, CREATOR_AGENT).unwrap();
    assert_sound(&ledger);
}
