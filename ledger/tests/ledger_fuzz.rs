//! Fuzz-style test of the ledger over raw bytes (issue 3, "Must show", bad input): a valid,
//! populated ledger file is damaged at random (bit flips, overwritten bytes, planted words,
//! truncation, extension) in the header page and in every writable section (state, slots,
//! records, buddy words, block links), then opened, checked and operated on. Any panic fails
//! the test (this runs in a debug build: overflow and out-of-bounds are panics too).
//!
//! What is expected:
//! * damage to the header (or a changed file size) is refused with a typed [`LedgerError`]
//!   (`NotALedger`, `Version`, `Corrupt`, `Truncated`);
//! * damage to a device's buddy header words may be refused as `Corrupt`; damage anywhere
//!   else in the writable sections is accepted (it is repaired, not refused);
//! * an accepted file: `check()` and every operation return without panicking; a ledger
//!   that `check()` finds sound stays sound under the operations (damage `check()` misses must
//!   be harmless); and once a repair has run (forced here by raising the dirty flag, as a
//!   holder killed mid-update leaves it), the only problems left are live records the space
//!   can no longer hold, which the repair keeps in the books on purpose.
//!
//! The 64 bytes of the robust mutex are left alone here: whoever can write the file can wedge
//! its lock, and no file format defends against that. What the node agent does with a file
//! whose lock (and every other byte) a workload rewrites is fuzzed in `agent_reads_fuzz.rs`.
use std::{
    mem::{offset_of, size_of},
    os::unix::fs::FileExt,
    path::PathBuf,
    sync::OnceLock,
};

use ledger::{
    layout::{Header, Record, Slot, SlotDevice, State, CREATOR_AGENT, PAGE},
    Charge, DeviceConfig, Geometry, Ledger, LedgerError, ProcessIdentity, RecordId, SlotId,
};
use proptest::prelude::*;

const MIB: u64 = 1 << 20;
const SLOTS: u32 = 8;
const RECORDS: u32 = 256;
/// Bytes of the robust mutex at the start of the state section.
const LOCK_BYTES: u64 = 64;

struct TempFile(PathBuf);

impl TempFile {
    fn new(tag: &str) -> TempFile {
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("ledger-fuzz-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        TempFile(path)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn identity(who: u32) -> ProcessIdentity {
    ProcessIdentity { pid: 200 + who, pidns: 9, start_time: 7000 + u64::from(who) }
}

/// A populated ledger's bytes and what the test knows about them.
struct Pristine {
    bytes: Vec<u8>,
    header: Header,
    /// (slot, record) pairs live in the file.
    owned: Vec<(SlotId, RecordId)>,
    /// Every record that is not free (allocations, small pools, contexts).
    used_records: Vec<RecordId>,
    /// Named sets of byte ranges of the file (the lock excluded) that damage is aimed at.
    sections: Vec<(&'static str, Vec<(u64, u64)>)>,
}

fn pristine() -> &'static Pristine {
    static PRISTINE: OnceLock<Pristine> = OnceLock::new();
    PRISTINE.get_or_init(|| {
        let file = TempFile::new("pristine");
        let geometry = Geometry {
            slots: SLOTS,
            records: RECORDS,
            devices: vec![
                // 32 chunks of 2 MiB, with a context reserve.
                DeviceConfig { limit: 64 * MIB, chunk: 2 * MIB, context_reserve: 3 * MIB, ..Default::default() },
                // 16384 chunks of 4 KiB: bitmaps with summary levels.
                DeviceConfig { limit: 64 * MIB, chunk: 4096, context_reserve: 0, ..Default::default() },
            ],
        };
        let ledger = Ledger::create(&file.0, &geometry, CREATOR_AGENT).unwrap();
        let mut owned = Vec::new();
        for who in 0..5 {
            let slot = ledger.register(identity(who)).unwrap();
            for i in 0..14u64 {
                let (device, charge) = match i {
                    0 => (0, Charge::Context),
                    1 => (1, Charge::Context),
                    _ => match i % 6 {
                    0 => (0, Charge::Device(300 << 10)),
                    1 => (0, Charge::Device(2 * MIB + 1)),
                    2 => (1, Charge::Device(1000 + i * 77)),
                    3 => (1, Charge::Device(5 * 4096 + i)),
                    4 => (1, Charge::Managed(3 * 4096)),
                    _ => (0, Charge::Managed(MIB)),
                    },
                };
                if let Ok(record) = ledger.reserve(slot, device, charge, 0x7f00_0000 + i) {
                    owned.push((slot, record));
                }
            }
        }
        // Holes in the spaces and a shuffled free-record list.
        let mut kept = Vec::new();
        for (i, &(slot, record)) in owned.iter().enumerate() {
            if i % 3 == 1 {
                ledger.release(slot, record).unwrap();
            } else {
                kept.push((slot, record));
            }
        }
        ledger.reclaim(3).unwrap();
        kept.retain(|&(slot, _)| slot != 3);
        let problems = ledger.check().unwrap();
        assert!(problems.is_empty(), "{problems:#?}");
        assert!(ledger.device_usage().unwrap().iter().all(|u| u.used_chunks > 0));
        let header = *ledger.header();
        drop(ledger);
        let bytes = std::fs::read(&file.0).unwrap();
        let h = &header;
        let slot_size = size_of::<Slot>() as u64;
        let record_size = size_of::<Record>() as u64;
        let slot_device_size = size_of::<SlotDevice>() as u64;
        let slots_end = h.slots_offset + u64::from(h.slot_count) * slot_size;
        let records_end = h.records_offset + u64::from(h.record_count) * record_size;
        // The parts in use: slot fields of the described devices, live records, non-zero
        // buddy words and links.
        let slot_used = offset_of!(Slot, devices) as u64 + u64::from(h.device_count) * slot_device_size;
        let used_slots = (0..u64::from(h.slot_count)).map(|i| h.slots_offset + i * slot_size).map(|at| (at, at + slot_used)).collect();
        let live_records = kept
            .iter()
            .map(|&(_, r)| h.records_offset + u64::from(r) * record_size)
            .map(|at| (at, at + record_size))
            .collect();
        let non_zero_words = |start: u64, end: u64| -> Vec<(u64, u64)> {
            (start..end).step_by(8).filter(|&at| bytes[at as usize..at as usize + 8].iter().any(|&b| b != 0)).map(|at| (at, at + 8)).collect()
        };
        let mut sections: Vec<(&'static str, Vec<(u64, u64)>)> = vec![
            ("header", vec![(0, size_of::<Header>() as u64)]),
            ("header page tail", vec![(size_of::<Header>() as u64, PAGE)]),
            ("state", vec![(PAGE + LOCK_BYTES, PAGE + size_of::<State>() as u64)]),
            ("slots", vec![(h.slots_offset, slots_end)]),
            ("slots in use", used_slots),
            ("records", vec![(h.records_offset, records_end)]),
            ("live records", live_records),
        ];
        for (d, names) in [
            (0usize, ["buddy header 0", "buddy words 0", "buddy words in use 0", "links 0", "links in use 0"]),
            (1, ["buddy header 1", "buddy words 1", "buddy words in use 1", "links 1", "links in use 1"]),
        ] {
            let cfg = h.devices[d];
            let (words, words_end) = (cfg.buddy_offset + 64, cfg.buddy_offset + cfg.buddy_words * 8);
            let (links, links_end) = (cfg.links_offset, cfg.links_offset + cfg.chunks * 8);
            sections.push((names[0], vec![(cfg.buddy_offset, cfg.buddy_offset + 64)]));
            sections.push((names[1], vec![(words, words_end)]));
            sections.push((names[2], non_zero_words(words, words_end)));
            sections.push((names[3], vec![(links, links_end)]));
            sections.push((names[4], non_zero_words(links, links_end)));
        }
        let used_records = (0..h.record_count)
            .filter(|&r| {
                let at = (h.records_offset + u64::from(r) * record_size) as usize;
                // SAFETY: Record is #[repr(C)] plain integers; the bytes lie inside the file.
                let record: Record = unsafe { std::ptr::read_unaligned(bytes[at..].as_ptr().cast()) };
                record.state != 0
            })
            .collect();
        Pristine { bytes, header, owned: kept, used_records, sections }
    })
}

#[derive(Clone, Debug)]
enum Damage {
    /// Flips bit `bit` of a byte of section `section`.
    Flip { section: usize, at: u64, bit: u8 },
    /// Overwrites bytes of a section.
    Bytes { section: usize, at: u64, bytes: Vec<u8> },
    /// Plants an aligned 8-byte (or, `narrow`, 4-byte) value in a section.
    Word { section: usize, at: u64, value: u64, narrow: bool },
    /// Cuts the file at `at` (a fraction of its length, in 1/65536ths).
    Truncate { at: u32 },
    /// Appends bytes.
    Extend { by: u16 },
    /// Points the small-pool (or, `context`, the context) link of a slot's device at a
    /// record the pristine file uses (links that look valid are the damage check() could
    /// miss).
    Link { slot: u32, device: u32, context: bool, pick: usize },
}

fn interesting() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(2),
        Just(3),
        Just(u64::MAX),
        Just(u64::from(u32::MAX)),
        Just(1 << 63),
        Just(1 << 32),
        0u64..64,
        0u64..400,
        (0u64..20_000).prop_map(|v| v << 8),
        any::<u64>(),
    ]
}

fn section() -> impl Strategy<Value = usize> {
    // Indices into `Pristine::sections`.
    prop_oneof![
        2 => Just(0usize), // header
        1 => Just(1),      // header page tail
        3 => Just(2),      // state
        1 => Just(3),      // slots
        3 => Just(4),      // slots in use
        2 => Just(5),      // records
        4 => Just(6),      // live records
        1 => Just(7),      // buddy header 0
        2 => Just(8),      // buddy words 0
        2 => Just(9),      // buddy words in use 0
        1 => Just(10),     // links 0
        2 => Just(11),     // links in use 0
        1 => Just(12),     // buddy header 1
        2 => Just(13),     // buddy words 1
        2 => Just(14),     // buddy words in use 1
        1 => Just(15),     // links 1
        2 => Just(16),     // links in use 1
    ]
}

fn damage() -> impl Strategy<Value = Damage> {
    prop_oneof![
        6 => (section(), any::<u64>(), 0u8..8).prop_map(|(section, at, bit)| Damage::Flip { section, at, bit }),
        3 => (section(), any::<u64>(), prop::collection::vec(any::<u8>(), 1..32))
            .prop_map(|(section, at, bytes)| Damage::Bytes { section, at, bytes }),
        8 => (section(), any::<u64>(), interesting(), any::<bool>())
            .prop_map(|(section, at, value, narrow)| Damage::Word { section, at, value, narrow }),
        1 => any::<u32>().prop_map(|at| Damage::Truncate { at: at % 65536 }),
        1 => (1u16..5000).prop_map(|by| Damage::Extend { by }),
        2 => (0..SLOTS, 0u32..2, any::<bool>(), any::<usize>())
            .prop_map(|(slot, device, context, pick)| Damage::Link { slot, device, context, pick }),
    ]
}

fn apply(bytes: &mut Vec<u8>, damage: &Damage, p: &Pristine) {
    let sections = &p.sections;
    // Where in `bytes` a damage of `width` aligned bytes lands, and the end of its section
    // (both within the file as it is now, which an earlier truncation may have shortened).
    let len = bytes.len();
    let place = |section: usize, at: u64, align: u64| -> Option<(usize, usize)> {
        let ranges = &sections[section].1;
        let (start, end) = ranges[(at % ranges.len() as u64) as usize];
        let at = at / ranges.len() as u64;
        let at = ((start + at % (end - start)) & !(align - 1)).max(start) as usize;
        (at < len).then_some((at, (end as usize).min(len)))
    };
    match damage {
        Damage::Flip { section, at, bit } => {
            if let Some((at, _)) = place(*section, *at, 1) {
                bytes[at] ^= 1 << bit;
            }
        }
        Damage::Bytes { section, at, bytes: new } => {
            if let Some((at, end)) = place(*section, *at, 1) {
                let n = new.len().min(end - at);
                bytes[at..at + n].copy_from_slice(&new[..n]);
            }
        }
        Damage::Word { section, at, value, narrow } => {
            let width = if *narrow { 4 } else { 8 };
            if let Some((at, end)) = place(*section, *at, width as u64) {
                let raw = value.to_ne_bytes();
                let n = width.min(end - at);
                bytes[at..at + n].copy_from_slice(&raw[..n]);
            }
        }
        Damage::Truncate { at } => {
            let len = (bytes.len() as u64 * u64::from(*at) / 65536) as usize;
            bytes.truncate(len);
        }
        Damage::Extend { by } => bytes.extend(std::iter::repeat_n(0xa5, *by as usize)),
        Damage::Link { slot, device, context, pick } => {
            let h = &p.header;
            let field = if *context { offset_of!(SlotDevice, context) } else { offset_of!(SlotDevice, small_pool) };
            let at = h.slots_offset as usize
                + *slot as usize * size_of::<Slot>()
                + offset_of!(Slot, devices)
                + *device as usize * size_of::<SlotDevice>()
                + field;
            let link = p.used_records[pick % p.used_records.len()] + 1;
            if at + 4 <= bytes.len() {
                bytes[at..at + 4].copy_from_slice(&link.to_ne_bytes());
            }
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    Register { who: u32 },
    Reserve { slot: u32, device: u32, kind: u8, raw: u64 },
    /// Releases one of the (slot, record) pairs the pristine file holds.
    ReleaseOwned { pick: usize },
    Release { slot: u32, record: u32 },
    Reclaim { slot: u32 },
    ReclaimDead,
    Read,
}

/// Mostly the slots live in the pristine file (0, 1, 2, 4), sometimes any (or one past).
fn slot() -> impl Strategy<Value = u32> {
    prop_oneof![3 => prop::sample::select(vec![0u32, 1, 2, 4]), 1 => 0u32..SLOTS + 1]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        1 => (0u32..8).prop_map(|who| Op::Register { who }),
        6 => (slot(), prop_oneof![9 => 0u32..2, 1 => Just(2u32)], 0u8..4, any::<u64>())
            .prop_map(|(slot, device, kind, raw)| Op::Reserve { slot, device, kind, raw }),
        4 => any::<usize>().prop_map(|pick| Op::ReleaseOwned { pick }),
        1 => (slot(), 0u32..RECORDS + 2).prop_map(|(slot, record)| Op::Release { slot, record }),
        1 => slot().prop_map(|slot| Op::Reclaim { slot }),
        1 => Just(Op::ReclaimDead),
        1 => Just(Op::Read),
    ]
}

/// Runs `op`; every outcome but a panic is acceptable here.
fn perform(ledger: &Ledger, op: &Op, owned: &[(SlotId, RecordId)]) {
    match *op {
        Op::Register { who } => drop(ledger.register(identity(who))),
        Op::Reserve { slot, device, kind, raw } => {
            let charge = match kind {
                0 => Charge::Device(1 + raw % (4 * MIB)),
                1 => Charge::Device(1 + raw % 8192),
                2 => Charge::Managed(1 + raw % (4 * MIB)),
                _ => Charge::Context,
            };
            drop(ledger.reserve(slot, device, charge, raw));
        }
        Op::ReleaseOwned { pick } => {
            if !owned.is_empty() {
                let (slot, record) = owned[pick % owned.len()];
                drop(ledger.release(slot, record));
            }
        }
        Op::Release { slot, record } => drop(ledger.release(slot, record)),
        Op::Reclaim { slot } => drop(ledger.reclaim(slot)),
        Op::ReclaimDead => drop(ledger.reclaim_dead()),
        Op::Read => {
            drop(ledger.device_usage());
            drop(ledger.slots());
            drop(ledger.repairs());
        }
    }
}

/// Problems a repair leaves on purpose: live records the space can no longer hold.
fn unplaceable(problem: &str) -> bool {
    problem.contains("should hold") || problem.contains("small pool holds")
}

fn run(damages: Vec<Damage>, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let p = pristine();
    let mut bytes = p.bytes.clone();
    for damage in &damages {
        apply(&mut bytes, damage, p);
    }
    let changed = |start: u64, end: u64| {
        let end = end as usize;
        bytes.len() < end || bytes[start as usize..end] != p.bytes[start as usize..end]
    };
    let header_changed = changed(0, size_of::<Header>() as u64);
    let size_changed = bytes.len() != p.bytes.len();
    let buddy_header_changed = !size_changed
        && (0..p.header.device_count as usize).any(|d| {
            let at = p.header.devices[d].buddy_offset;
            changed(at, at + 64)
        });
    let file = TempFile::new("case");
    std::fs::write(&file.0, &bytes).unwrap();

    let opened = Ledger::open(&file.0);
    if header_changed || size_changed {
        let typed = matches!(
            opened,
            Err(LedgerError::NotALedger { .. } | LedgerError::Version { .. } | LedgerError::Corrupt { .. } | LedgerError::Truncated { .. })
        );
        prop_assert!(typed, "a damaged header or size was not refused with a typed error: {:?}", opened.err());
        if !header_changed {
            prop_assert!(matches!(opened, Err(LedgerError::Truncated { .. })), "resized file: {:?}", opened.err());
        }
        return Ok(());
    }
    let ledger = match opened {
        Ok(ledger) => ledger,
        Err(LedgerError::Corrupt { what, .. }) if buddy_header_changed => {
            prop_assert!(what.contains("buddy"), "{}", what);
            return Ok(());
        }
        Err(error) => return Err(TestCaseError::fail(format!("damage to the writable sections refused at open: {error}"))),
    };

    // Whatever check() says, operations must not panic; and a ledger it finds sound stays so.
    let mut sound = ledger.check().unwrap().is_empty();
    for (step, op) in ops.iter().enumerate() {
        perform(&ledger, op, &p.owned);
        let problems = ledger.check().unwrap();
        prop_assert!(
            !sound || problems.is_empty(),
            "step {step}: {op:?} on a ledger check() found sound left: {problems:#?}"
        );
        sound = problems.is_empty();
    }

    // A holder killed mid-update leaves the dirty flag raised: the next locker repairs.
    let repairs = ledger.repairs().unwrap();
    let raw = std::fs::OpenOptions::new().write(true).open(&file.0).unwrap();
    raw.write_all_at(&1u32.to_ne_bytes(), PAGE + offset_of!(State, dirty) as u64).unwrap();
    let problems = ledger.check().unwrap();
    prop_assert_eq!(ledger.repairs().unwrap(), repairs.wrapping_add(1));
    let left: Vec<&String> = problems.iter().filter(|p| !unplaceable(p)).collect();
    prop_assert!(left.is_empty(), "after a repair: {:#?}", problems);
    for op in &ops {
        perform(&ledger, op, &p.owned);
        let after = ledger.check().unwrap();
        let left: Vec<&String> = after.iter().filter(|p| !unplaceable(p)).collect();
        prop_assert!(left.is_empty(), "{op:?} after a repair left: {after:#?}");
    }
    Ok(())
}

proptest! {
    // 256 cases (proptest's default); PROPTEST_CASES=20000 hunts longer.

    #[test]
    fn damaged_files_never_panic(
        damages in prop::collection::vec(damage(), 1..6),
        ops in prop::collection::vec(op(), 0..16),
    ) {
        run(damages, ops)?;
    }
}

#[test]
fn the_pristine_file_is_sound_and_every_section_is_aimed_at() {
    let p = pristine();
    let file = TempFile::new("sound");
    std::fs::write(&file.0, &p.bytes).unwrap();
    let ledger = Ledger::open(&file.0).unwrap();
    assert!(ledger.check().unwrap().is_empty());
    assert_eq!(p.sections.len(), 17);
    for (name, ranges) in &p.sections {
        assert!(!ranges.is_empty(), "{name}");
        for (start, end) in ranges {
            assert!(start < end && *end <= p.bytes.len() as u64, "{name}: {start}..{end}");
            assert!(*start >= PAGE + LOCK_BYTES || *end <= PAGE, "{name} touches the lock");
        }
        // Each section is one the pristine file uses (not all zeros), but for the unused
        // tail of the header page.
        let used = ranges.iter().any(|&(a, b)| p.bytes[a as usize..b as usize].iter().any(|&x| x != 0));
        assert!(used || *name == "header page tail", "{name} is all zeros");
    }
}

/// The damage `check()` once missed: a slot's small-pool link aimed at another slot's pool
/// looks valid, and the next small allocation grows the other slot's pool; a context link
/// aimed at another slot's context hands that record out as the caller's. `check()` reports
/// both before any operation follows them, and a repair restores the links.
#[test]
fn damaged_links_are_reported_and_repaired() {
    let file = TempFile::new("links");
    let geometry = Geometry {
        slots: 4,
        records: 64,
        devices: vec![DeviceConfig { limit: 64 * MIB, chunk: 2 * MIB, context_reserve: MIB, ..Default::default() }],
    };
    let ledger = Ledger::create(&file.0, &geometry, CREATOR_AGENT).unwrap();
    let a = ledger.register(identity(1)).unwrap();
    let b = ledger.register(identity(2)).unwrap();
    ledger.reserve(a, 0, Charge::Device(MIB), 0).unwrap();
    ledger.reserve(b, 0, Charge::Device(MIB), 0).unwrap();
    let b_context = ledger.reserve(b, 0, Charge::Context, 0).unwrap();
    let b_pool = ledger.slots().unwrap().iter().find(|v| v.id == b).unwrap().slot.devices[0].small_pool;
    assert!(ledger.check().unwrap().is_empty());

    let h = *ledger.header();
    let at = h.slots_offset + u64::from(a) * size_of::<Slot>() as u64 + offset_of!(Slot, devices) as u64;
    let raw = std::fs::OpenOptions::new().write(true).open(&file.0).unwrap();
    raw.write_all_at(&b_pool.to_ne_bytes(), at + offset_of!(SlotDevice, small_pool) as u64).unwrap();
    raw.write_all_at(&(b_context + 1).to_ne_bytes(), at + offset_of!(SlotDevice, context) as u64).unwrap();
    let problems = ledger.check().unwrap();
    assert!(problems.iter().any(|p| p.contains("small pool link")), "{problems:#?}");
    assert!(problems.iter().any(|p| p.contains("context link")), "{problems:#?}");

    raw.write_all_at(&1u32.to_ne_bytes(), PAGE + offset_of!(State, dirty) as u64).unwrap();
    assert!(ledger.check().unwrap().is_empty());
    ledger.reserve(a, 0, Charge::Device(MIB + 1), 0).unwrap();
    assert_ne!(ledger.reserve(a, 0, Charge::Context, 0).unwrap(), b_context);
    let problems = ledger.check().unwrap();
    assert!(problems.is_empty(), "{problems:#?}");
    assert_eq!(ledger.device_usage().unwrap()[0].used_chunks, 2 + 1 + 1 + 1);
}
