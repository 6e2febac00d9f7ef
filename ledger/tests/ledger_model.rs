//! Property test of the ledger against a plain model (issue 3, "Must show"): random
//! sequences of register / reserve / release / reclaim across several slots and one or two
//! devices. The model knows nothing of buddies, chains or pools: per (slot, device) it keeps
//! the live small bytes, the whole-chunk data and managed charges and the context, and from
//! them computes what the driver's rules charge:
//!
//! * a device allocation of a chunk or more takes ceil(bytes / chunk) chunks of its own;
//! * smaller ones are packed: a (slot, device) is charged ceil(live small bytes / chunk);
//! * managed memory takes ceil(bytes / chunk) chunks;
//! * the context reserve is charged once per (slot, device);
//! * a charge is admitted iff the chunks it adds fit under the device's limit.
//!
//! After every step `check()` finds nothing, every device's usage and rejections equal the
//! model's, and every live slot's per-kind bytes, chunks and counters equal the model's.
//! Refusals happen exactly when the model says the quota cannot hold the charge, and say so
//! with the model's figures.
use std::{collections::HashSet, path::PathBuf};

use ledger::{
    layout::CREATOR_AGENT, Charge, DeviceConfig, Geometry, Kind, Ledger, LedgerError, ProcessIdentity, RecordId,
    ReserveError, SlotId,
};
use proptest::prelude::*;

const SLOTS: u32 = 4;
const IDENTITIES: u32 = 6;

struct TempFile(PathBuf);

impl TempFile {
    fn new() -> TempFile {
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("ledger-model-{}-{n}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        TempFile(path)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A size drawn relative to the case's chunk: `mode` picks the family, `raw` the value.
#[derive(Clone, Copy, Debug)]
struct Size {
    mode: u8,
    raw: u64,
}

impl Size {
    fn bytes(self, chunk: u64) -> u64 {
        match self.mode % 5 {
            0 => 1 + self.raw % 4096,                // tiny
            1 => 1 + self.raw % chunk,               // up to one chunk (both sides of it)
            2 => chunk * (1 + self.raw % 4),         // exact multiples
            3 => chunk - 1 + self.raw % 3,           // around the chunk boundary
            _ => 1 + self.raw % (6 * chunk),         // anything up to several chunks
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum ChargeSpec {
    Device(Size),
    Managed(Size),
    Context,
}

#[derive(Clone, Copy, Debug)]
enum Op {
    /// Registers identity `who` (a live one again: the exec path).
    Register { who: u32 },
    /// Reserves for the `pick`-th live slot (or, `stale`, for a slot that is not live) on
    /// device `device` modulo the device count (or, `bad_device`, one past the last).
    Reserve { pick: usize, stale: bool, device: u32, bad_device: bool, charge: ChargeSpec },
    /// Releases the `record`-th live record of the `pick`-th live slot (or, `foreign`, a
    /// record that is not that slot's).
    Release { pick: usize, record: usize, foreign: bool },
    /// Reclaims the `pick`-th live slot (or, `stale`, a slot that is not live).
    Reclaim { pick: usize, stale: bool },
}

fn size() -> impl Strategy<Value = Size> {
    (any::<u8>(), any::<u64>()).prop_map(|(mode, raw)| Size { mode, raw })
}

fn charge() -> impl Strategy<Value = ChargeSpec> {
    prop_oneof![
        6 => size().prop_map(ChargeSpec::Device),
        2 => size().prop_map(ChargeSpec::Managed),
        1 => Just(ChargeSpec::Context),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (0..IDENTITIES).prop_map(|who| Op::Register { who }),
        10 => (any::<usize>(), prop::bool::weighted(0.03), 0u32..2, prop::bool::weighted(0.03), charge())
            .prop_map(|(pick, stale, device, bad_device, charge)| Op::Reserve { pick, stale, device, bad_device, charge }),
        5 => (any::<usize>(), any::<usize>(), prop::bool::weighted(0.1))
            .prop_map(|(pick, record, foreign)| Op::Release { pick, record, foreign }),
        1 => (any::<usize>(), prop::bool::weighted(0.2)).prop_map(|(pick, stale)| Op::Reclaim { pick, stale }),
    ]
}

#[derive(Clone, Debug)]
struct Setup {
    chunk: u64,
    /// Per device: limit in chunks (0: a device with no space), context reserve in bytes.
    devices: Vec<(u64, u64)>,
}

fn setup() -> impl Strategy<Value = Setup> {
    let chunk = prop_oneof![Just(4096u64), Just(64 << 10), Just(2 << 20)];
    (chunk, prop::collection::vec((0u64..40, 0u8..5), 1..=2)).prop_map(|(chunk, devices)| Setup {
        chunk,
        devices: devices
            .into_iter()
            .map(|(chunks, reserve)| {
                let reserve = match reserve {
                    0 => 0,
                    1 => 1,
                    2 => chunk / 2,
                    3 => chunk + chunk / 2,
                    _ => 3 * chunk,
                };
                (chunks, reserve)
            })
            .collect(),
    })
}

/// One live allocation as the model knows it.
#[derive(Clone, Copy, Debug)]
struct MRecord {
    id: RecordId,
    device: u32,
    kind: Kind,
    bytes: u64,
}

#[derive(Clone, Debug)]
struct MSlot {
    who: u32,
    records: Vec<MRecord>,
    allocs: u64,
    frees: u64,
    rejections: u64,
}

struct Model {
    chunk: u64,
    limits: Vec<u64>,
    reserves: Vec<u64>,
    slots: Vec<Option<MSlot>>,
    rejections: Vec<u64>,
}

impl Model {
    fn identity(who: u32) -> ProcessIdentity {
        ProcessIdentity { pid: 100 + who, pidns: 7, start_time: 5000 + u64::from(who) }
    }

    /// Chunks charged to `slot` on `device` by the rules, per kind.
    fn charged(&self, slot: &MSlot, device: u32) -> ([u64; 4], [u64; 4]) {
        let (mut bytes, mut chunks) = ([0u64; 4], [0u64; 4]);
        for r in slot.records.iter().filter(|r| r.device == device) {
            bytes[r.kind as usize] += r.bytes;
            if r.kind != Kind::Small {
                chunks[r.kind as usize] += r.bytes.div_ceil(self.chunk);
            }
        }
        chunks[Kind::Small as usize] = bytes[Kind::Small as usize].div_ceil(self.chunk);
        (bytes, chunks)
    }

    fn slot_chunks(&self, slot: &MSlot, device: u32) -> u64 {
        self.charged(slot, device).1.iter().sum()
    }

    fn used(&self, device: u32) -> u64 {
        self.slots.iter().flatten().map(|s| self.slot_chunks(s, device)).sum()
    }

    fn live_ids(&self) -> Vec<SlotId> {
        (0..self.slots.len() as SlotId).filter(|&i| self.slots[i as usize].is_some()).collect()
    }
}

fn kind_of(charge: Charge, chunk: u64) -> Kind {
    match charge {
        Charge::Device(b) if b < chunk => Kind::Small,
        Charge::Device(_) => Kind::Data,
        Charge::Managed(_) => Kind::Managed,
        Charge::Context | Charge::AnotherContext => Kind::Context,
    }
}

fn run(setup: Setup, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let file = TempFile::new();
    let chunk = setup.chunk;
    let geometry = Geometry {
        slots: SLOTS,
        records: 512,
        devices: setup
            .devices
            .iter()
            .map(|&(chunks, context_reserve)| DeviceConfig { limit: chunks * chunk, chunk, context_reserve, ..Default::default() })
            .collect(),
    };
    let ledger = Ledger::create(&file.0, &geometry, CREATOR_AGENT).unwrap();
    let devices = setup.devices.len() as u32;
    let mut m = Model {
        chunk,
        limits: setup.devices.iter().map(|d| d.0).collect(),
        reserves: setup.devices.iter().map(|d| d.1).collect(),
        slots: vec![None; SLOTS as usize],
        rejections: vec![0; devices as usize],
    };
    for (step, op) in ops.into_iter().enumerate() {
        let live = m.live_ids();
        let stale_slot = (0..SLOTS + 2).find(|s| m.slots.get(*s as usize).is_none_or(|x| x.is_none())).unwrap();
        match op {
            Op::Register { who } => {
                let existing = live.iter().copied().find(|&s| m.slots[s as usize].as_ref().unwrap().who == who);
                let expected = existing.or_else(|| m.slots.iter().position(|s| s.is_none()).map(|s| s as SlotId));
                match (ledger.register(Model::identity(who)), expected) {
                    (Ok(got), Some(want)) => {
                        prop_assert_eq!(got, want, "step {}: register {} took the wrong slot", step, who);
                        m.slots[want as usize] = Some(MSlot { who, records: Vec::new(), allocs: 0, frees: 0, rejections: 0 });
                    }
                    (Err(LedgerError::NoFreeSlot(n)), None) => prop_assert_eq!(n, SLOTS),
                    (got, want) => prop_assert!(false, "step {step}: register {who}: got {got:?}, model says {want:?}"),
                }
            }
            Op::Reserve { pick, stale, device, bad_device, charge: spec } => {
                let device = if bad_device { devices } else { device % devices };
                let charge = match spec {
                    ChargeSpec::Device(s) => Charge::Device(s.bytes(chunk)),
                    ChargeSpec::Managed(s) => Charge::Managed(s.bytes(chunk)),
                    ChargeSpec::Context => Charge::Context,
                };
                if stale || live.is_empty() {
                    let got = ledger.reserve(stale_slot, 0, charge, 0);
                    prop_assert!(
                        matches!(got, Err(ReserveError::Ledger(LedgerError::UnknownSlot(s))) if s == stale_slot),
                        "step {step}: reserve on dead slot {stale_slot}: {got:?}"
                    );
                    continue;
                }
                let slot = live[pick % live.len()];
                let got = ledger.reserve(slot, device, charge, step as u64);
                if device >= devices {
                    prop_assert!(
                        matches!(got, Err(ReserveError::Ledger(LedgerError::UnknownDevice(d))) if d == device),
                        "step {step}: reserve on device {device}: {got:?}"
                    );
                    continue;
                }
                let kind = kind_of(charge, chunk);
                let ms = m.slots[slot as usize].as_ref().unwrap();
                let existing_context =
                    ms.records.iter().find(|r| r.kind == Kind::Context && r.device == device).map(|r| r.id);
                if let (Charge::Context, Some(id)) = (charge, existing_context) {
                    prop_assert!(matches!(got, Ok(g) if g == id), "step {step}: a second context: {got:?}, first {id}");
                    continue;
                }
                let bytes = match charge {
                    Charge::Device(b) | Charge::Managed(b) => b,
                    Charge::Context | Charge::AnotherContext => m.reserves[device as usize],
                };
                let before = m.slot_chunks(ms, device);
                let mut after_slot = ms.clone();
                after_slot.records.push(MRecord { id: u32::MAX, device, kind, bytes });
                let need = m.slot_chunks(&after_slot, device) - before;
                let used = m.used(device);
                let limit = m.limits[device as usize];
                if used + need > limit {
                    match got {
                        Err(ReserveError::OverQuota { device: d, requested, used: u, limit: l }) => {
                            prop_assert_eq!(
                                (d, requested, u, l),
                                (device, need * chunk, used * chunk, limit * chunk),
                                "step {}: refusal figures", step
                            );
                        }
                        other => prop_assert!(
                            false,
                            "step {step}: {charge:?} needs {need} chunks with {used} of {limit} used: the model refuses, the ledger said {other:?}"
                        ),
                    }
                    m.slots[slot as usize].as_mut().unwrap().rejections += 1;
                    m.rejections[device as usize] += 1;
                } else {
                    let id = match got {
                        Ok(id) => id,
                        other => {
                            return Err(TestCaseError::fail(format!(
                                "step {step}: {charge:?} needs {need} chunks with {used} of {limit} used: the model admits, the ledger said {other:?}"
                            )))
                        }
                    };
                    let taken: HashSet<RecordId> =
                        m.slots.iter().flatten().flat_map(|s| s.records.iter().map(|r| r.id)).collect();
                    prop_assert!(!taken.contains(&id), "step {}: record {} handed out twice", step, id);
                    let ms = m.slots[slot as usize].as_mut().unwrap();
                    ms.records.push(MRecord { id, device, kind, bytes });
                    ms.allocs += 1;
                }
            }
            Op::Release { pick, record, foreign } => {
                if live.is_empty() {
                    continue;
                }
                let slot = live[pick % live.len()];
                let mine = &m.slots[slot as usize].as_ref().unwrap().records;
                if foreign || mine.is_empty() {
                    let others: Vec<RecordId> = live
                        .iter()
                        .filter(|&&s| s != slot)
                        .flat_map(|&s| m.slots[s as usize].as_ref().unwrap().records.iter().map(|r| r.id))
                        .collect();
                    let id = if others.is_empty() { 100_000 + record as u32 % 1000 } else { others[record % others.len()] };
                    let got = ledger.release(slot, id);
                    prop_assert!(
                        matches!(got, Err(LedgerError::UnknownRecord(r)) if r == id),
                        "step {step}: slot {slot} released record {id} that is not its own: {got:?}"
                    );
                    continue;
                }
                let index = record % mine.len();
                let id = mine[index].id;
                let got = ledger.release(slot, id);
                prop_assert!(got.is_ok(), "step {step}: release {id} of slot {slot}: {got:?}");
                let ms = m.slots[slot as usize].as_mut().unwrap();
                ms.records.remove(index);
                ms.frees += 1;
                // A second release of the same record is refused.
                let again = ledger.release(slot, id);
                prop_assert!(matches!(again, Err(LedgerError::UnknownRecord(_))), "step {step}: double release: {again:?}");
            }
            Op::Reclaim { pick, stale } => {
                if stale || live.is_empty() {
                    let got = ledger.reclaim(stale_slot);
                    prop_assert!(
                        matches!(got, Err(LedgerError::UnknownSlot(s)) if s == stale_slot),
                        "step {step}: reclaim of dead slot {stale_slot}: {got:?}"
                    );
                    continue;
                }
                let slot = live[pick % live.len()];
                let ms = m.slots[slot as usize].take().unwrap();
                let want: u64 = (0..devices).map(|d| m.slot_chunks(&ms, d)).sum();
                let got = ledger.reclaim(slot);
                prop_assert!(matches!(got, Ok(n) if n == want), "step {step}: reclaim of slot {slot}: {got:?}, model frees {want}");
            }
        }
        compare(&ledger, &m, step)?;
    }
    Ok(())
}

/// The ledger against the model, and its own invariants.
fn compare(ledger: &Ledger, m: &Model, step: usize) -> Result<(), TestCaseError> {
    let problems = ledger.check().unwrap();
    prop_assert!(problems.is_empty(), "step {step}: invariants violated: {problems:#?}");
    let usage = ledger.device_usage().unwrap();
    prop_assert_eq!(usage.len(), m.limits.len());
    for (d, u) in usage.iter().enumerate() {
        prop_assert_eq!(u.used_chunks, m.used(d as u32), "step {}: device {} used chunks", step, d);
        prop_assert!(u.used_chunks <= m.limits[d], "step {step}: device {d} over its limit");
        prop_assert_eq!(u.rejections, m.rejections[d], "step {}: device {} rejections", step, d);
    }
    let views = ledger.slots().unwrap();
    let ids: Vec<SlotId> = views.iter().map(|v| v.id).collect();
    prop_assert_eq!(ids, m.live_ids(), "step {}: live slots", step);
    for view in views {
        let ms = m.slots[view.id as usize].as_ref().unwrap();
        let who = Model::identity(ms.who);
        prop_assert_eq!((view.slot.pid, view.slot.pidns, view.slot.start_time), (who.pid, who.pidns, who.start_time));
        prop_assert_eq!(
            (view.slot.allocs, view.slot.frees, view.slot.rejections),
            (ms.allocs, ms.frees, ms.rejections),
            "step {}: slot {} counters", step, view.id
        );
        for d in 0..m.limits.len() as u32 {
            let (bytes, chunks) = m.charged(ms, d);
            let have = view.slot.devices[d as usize];
            prop_assert_eq!((have.bytes, have.chunks), (bytes, chunks), "step {}: slot {} device {} bytes/chunks by kind", step, view.id, d);
        }
    }
    Ok(())
}

proptest! {
    // 256 cases (proptest's default); PROPTEST_CASES=20000 hunts longer.

    #[test]
    fn ledger_matches_the_model(setup in setup(), ops in prop::collection::vec(op(), 1..150)) {
        run(setup, ops)?;
    }
}
