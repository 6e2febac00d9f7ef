//! The ledger's tables while the lock is held, and what is done to them: reserve, release,
//! reclaim, the repair that rebuilds derived state from the committed records, and the
//! invariant check.
//!
//! Block chains: the blocks of one record are a singly linked chain threaded through the
//! device's `links` array, one u64 per chunk. For a block starting at chunk `c`,
//! `links[c] = (next + 1) << 8 | order` where `next` is the next block's first chunk (and
//! `next + 1 == 0` ends the chain); a record's `head` is its first block's chunk + 1.
//! Everything read from the file is bounds-checked before use: a damaged chain is reported
//! (and repaired), never followed out of bounds.
use std::collections::{HashMap, HashSet};

use crate::{
    buddy::{AllocFlags, Block, Buddy, Geometry},
    error::{LedgerError, ReserveError},
    file::Mapped,
    layout::{
        Header, Kind, Record, Slot, SlotDevice, State, MAX_DEVICES, RECORD_FREE, RECORD_LIVE, RECORD_POOL,
        SLOT_FREE, SLOT_LIVE,
    },
    ledger::{Charge, RecordId, SlotId},
};

/// The tables of a locked ledger.
pub struct Tables<'a> {
    pub header: &'a Header,
    pub state: &'a mut State,
    pub slots: &'a mut [Slot],
    pub records: &'a mut [Record],
    /// The mapping, for the devices' buddy words and block links ([`Tables::device`]); they
    /// are sliced on demand, which costs less than building every device's slices up front.
    pub mapped: &'a Mapped,
    /// Buddy geometry of each device, computed once per process (`None`: a device with no
    /// space, whose every charge is refused).
    pub geometries: &'a [Option<Geometry>],
}

pub fn zeroed_slot() -> Slot {
    Slot {
        state: SLOT_FREE,
        pid: 0,
        pidns: 0,
        start_time: 0,
        host_pid: 0,
        flags: 0,
        allocs: 0,
        frees: 0,
        rejections: 0,
        devices: [SlotDevice::default(); MAX_DEVICES],
    }
}

/// An internal inconsistency met while mutating: the caller repairs.
struct Damaged;

impl<'a> Tables<'a> {
    /// Device `d`'s buddy words and block links (`None` past the file's devices, and for a
    /// device with no space: a limit of less than one chunk).
    pub fn device(&mut self, d: usize) -> Option<(&mut [u64], &mut [u64])> {
        if d >= (self.header.device_count as usize).min(MAX_DEVICES) || self.header.devices[d].chunks == 0 {
            return None;
        }
        let cfg = &self.header.devices[d];
        // SAFETY: the offsets and lengths were validated against the file size and the layout
        // by `file::validate` (or computed by `file::plan` at creation): both sections lie in
        // the mapping, are 8-aligned, overlap no other section (the state, slots and records
        // this struct also borrows included) and hold plain integers valid for any bit
        // pattern. The slices borrow `self` mutably, so no two of them are alive at once.
        unsafe {
            Some((
                std::slice::from_raw_parts_mut(self.mapped.at(cfg.buddy_offset).cast(), cfg.buddy_words as usize),
                std::slice::from_raw_parts_mut(self.mapped.at(cfg.links_offset).cast(), cfg.chunks as usize),
            ))
        }
    }

    /// The slots that may be live (all beyond are free).
    pub fn used_slots(&self) -> usize {
        (self.state.slots_in_use as usize).min(self.slots.len())
    }

    /// The records that may be in use (all beyond are free).
    pub fn used_records(&self) -> usize {
        (self.state.records_in_use as usize).min(self.records.len())
    }

    fn chunk(&self, device: u32) -> u64 {
        self.header.devices[device as usize].chunk
    }

    /// ceil(bytes / chunk), by shifts: a validated header's chunks are powers of two (a
    /// 64-bit division showed in profiles).
    fn chunks_for(&self, device: u32, bytes: u64) -> u64 {
        let chunk = self.chunk(device);
        (bytes >> chunk.trailing_zeros()) + u64::from(bytes & (chunk - 1) != 0)
    }

    /// Allocates `chunks` chunks on `device` for `slot` and chains them onto `head`.
    /// Returns false (and changes nothing) if the quota cannot hold them.
    fn take(&mut self, device: u32, slot: SlotId, chunks: u64, head: &mut u64) -> Result<bool, Damaged> {
        if chunks == 0 {
            return Ok(true);
        }
        let d = device as usize;
        let cfg = self.header.devices[d];
        if chunks > cfg.chunks {
            // More than the whole quota (the buddy would call the request malformed).
            return Ok(false);
        }
        let geometry = self.geometries.get(d).and_then(Option::as_ref).ok_or(Damaged)?;
        let used = self.state.devices[d].used_chunks;
        let (words, links) = self.device(d).ok_or(Damaged)?;
        let mut buddy = Buddy::attach_with(words, geometry).map_err(|_| Damaged)?;
        // The usage counter and the buddy space are both derived state that damage to the
        // file can change: admit only from a pair that agrees, so the buddy's verdict is the
        // limit's (and the debug assertion in `try_reserve` fires only on an accounting bug).
        if cfg.chunks.checked_sub(used).map(|free| free * cfg.chunk) != Some(buddy.avail()) {
            return Err(Damaged);
        }
        let blocks = match buddy.alloc_blocks(0, cfg.limit, chunks * cfg.chunk, cfg.chunk, AllocFlags::NONE, slot) {
            Ok(blocks) => blocks,
            Err(crate::buddy::BuddyError::NoSpace) => return Ok(false),
            Err(_) => return Err(Damaged),
        };
        let shift = cfg.chunk.trailing_zeros();
        for block in blocks {
            let first = block.offset >> shift;
            let Some(link) = links.get_mut(first as usize) else { return Err(Damaged) };
            *link = (*head << 8) | u64::from(block.order);
            *head = first + 1;
        }
        let used = &mut self.state.devices[d].used_chunks;
        *used = used.saturating_add(chunks);
        Ok(true)
    }

    /// Frees the chain starting at `head`; returns the chunks freed.
    fn give_back(&mut self, device: u32, head: u64) -> Result<u64, Damaged> {
        if device >= self.header.device_count {
            return Err(Damaged); // a damaged record's device
        }
        if head == 0 {
            // Nothing held (a record of no chunks, e.g. a context of no reserve): nothing to
            // give back, also on a device with no space (which has no buddy to give it to).
            return Ok(0);
        }
        let d = device as usize;
        let cfg = self.header.devices[d];
        let geometry = self.geometries.get(d).and_then(Option::as_ref).ok_or(Damaged)?;
        let (words, links) = self.device(d).ok_or(Damaged)?;
        let mut buddy = Buddy::attach_with(words, geometry).map_err(|_| Damaged)?;
        let mut freed = 0;
        let mut next = head;
        let mut steps = 0u64;
        while next != 0 {
            steps += 1;
            if steps > cfg.chunks {
                return Err(Damaged); // a cycle
            }
            let first = next - 1;
            let Some(link) = links.get_mut(first as usize) else { return Err(Damaged) };
            let (following, order) = (*link >> 8, (*link & 0xff) as u32);
            *link = 0;
            let size = cfg.chunk.checked_shl(order).ok_or(Damaged)?;
            let block = Block { offset: first * cfg.chunk, order, size };
            buddy.free_block(&block).map_err(|_| Damaged)?;
            freed += size >> cfg.chunk.trailing_zeros(); // size / chunk: chunks are powers of two
            next = following;
        }
        let used = &mut self.state.devices[d].used_chunks;
        *used = used.saturating_sub(freed);
        Ok(freed)
    }

    /// Pops a free record.
    fn new_record(&mut self) -> Result<Option<RecordId>, Damaged> {
        let head = self.state.free_record;
        if head == 0 {
            return Ok(None);
        }
        let index = head - 1;
        let record = self.records.get(index as usize).ok_or(Damaged)?;
        if record.state != RECORD_FREE {
            return Err(Damaged);
        }
        self.state.free_record = record.next_free;
        self.state.records_in_use = self.state.records_in_use.max(index + 1);
        Ok(Some(index))
    }

    fn drop_record(&mut self, id: RecordId) {
        let head = self.state.free_record;
        let record = &mut self.records[id as usize];
        *record = Record { next_free: head, ..Record::default() };
        self.state.free_record = id + 1;
    }
}

/// Admits `charge` for `slot` on `device` (see the module docs of `ledger` for the rules).
pub fn reserve(t: &mut Tables<'_>, slot: SlotId, device: u32, charge: Charge, ptr: u64) -> Result<RecordId, ReserveError> {
    if t.slots.get(slot as usize).is_none_or(|s| s.state != SLOT_LIVE) {
        return Err(LedgerError::UnknownSlot(slot).into());
    }
    if device >= t.header.device_count {
        return Err(LedgerError::UnknownDevice(device).into());
    }
    match try_reserve(t, slot, device, charge, ptr) {
        Ok(result) => result,
        Err(Damaged) => {
            repair(t);
            try_reserve(t, slot, device, charge, ptr).unwrap_or_else(|Damaged| {
                Err(LedgerError::Corrupt { path: Default::default(), what: "the ledger stays damaged after a repair".into() }.into())
            })
        }
    }
}

// Inlined: its result, returned through memory and copied out at once, stalled the caller.
#[inline(always)]
fn try_reserve(
    t: &mut Tables<'_>,
    slot: SlotId,
    device: u32,
    charge: Charge,
    ptr: u64,
) -> Result<Result<RecordId, ReserveError>, Damaged> {
    let (s, d) = (slot as usize, device as usize);
    let chunk = t.chunk(device);
    let (kind, bytes) = match charge {
        Charge::Device(bytes) if bytes < chunk => (Kind::Small, bytes),
        Charge::Device(bytes) => (Kind::Data, bytes),
        Charge::Managed(bytes) => (Kind::Managed, bytes),
        Charge::Context => {
            if let Some(existing) = t.slots[s].devices[d].context.checked_sub(1) {
                return Ok(Ok(existing));
            }
            (Kind::Context, t.header.devices[d].context_reserve)
        }
        Charge::AnotherContext => (Kind::Context, t.header.devices[d].context_reserve),
    };
    if t.state.devices[d].used_chunks > t.header.devices[d].chunks {
        return Err(Damaged); // a damaged counter (take() also checks it against the buddy)
    }
    let Some(id) = t.new_record()? else {
        return Ok(Err(LedgerError::NoFreeRecord(t.header.record_count).into()));
    };
    // Chunks this charge adds: for a small one, what the packed pool grows by (0 or 1).
    let (chunks, admitted) = if kind == Kind::Small {
        let sd = t.slots[s].devices[d];
        let grow = sd.bytes[Kind::Small as usize].saturating_add(bytes).div_ceil(chunk).saturating_sub(sd.chunks[Kind::Small as usize]);
        (grow, grow == 0 || grow_small_pool(t, slot, device, grow)?)
    } else {
        let chunks = t.chunks_for(device, bytes);
        let mut head = 0;
        let admitted = t.take(device, slot, chunks, &mut head)?;
        t.records[id as usize].head = head;
        (chunks, admitted)
    };
    if !admitted {
        t.drop_record(id);
        t.slots[s].rejections = t.slots[s].rejections.saturating_add(1);
        t.state.devices[d].rejections = t.state.devices[d].rejections.saturating_add(1);
        let cfg = &t.header.devices[d];
        return Ok(Err(ReserveError::OverQuota {
            device,
            requested: chunks.saturating_mul(chunk),
            used: t.state.devices[d].used_chunks.saturating_mul(chunk),
            limit: cfg.limit,
        }));
    }
    let record = &mut t.records[id as usize];
    record.slot = slot;
    record.device = device;
    record.kind = kind as u32;
    record.ptr = ptr;
    record.bytes = bytes;
    record.chunks = if kind == Kind::Small { 0 } else { chunks };
    record.next_free = 0;
    record.state = RECORD_LIVE; // commits the allocation
    let sd = &mut t.slots[s].devices[d];
    sd.bytes[kind as usize] = sd.bytes[kind as usize].saturating_add(bytes);
    if kind != Kind::Small {
        sd.chunks[kind as usize] = sd.chunks[kind as usize].saturating_add(chunks);
    }
    if charge == Charge::Context {
        sd.context = id + 1;
    }
    t.slots[s].allocs = t.slots[s].allocs.saturating_add(1);
    debug_assert!(
        t.state.devices[d].used_chunks <= t.header.devices[d].chunks,
        "admission let device {device} exceed its limit"
    );
    Ok(Ok(id))
}

/// Adds `grow` chunks to the slot's small pool on `device`, creating the pool record if needed.
fn grow_small_pool(t: &mut Tables<'_>, slot: SlotId, device: u32, grow: u64) -> Result<bool, Damaged> {
    let (s, d) = (slot as usize, device as usize);
    let pool = match t.slots[s].devices[d].small_pool.checked_sub(1) {
        Some(pool) => pool,
        None => {
            let Some(pool) = t.new_record()? else { return Ok(false) };
            let record = &mut t.records[pool as usize];
            *record = Record { slot, device, kind: Kind::Small as u32, state: RECORD_POOL, ..Record::default() };
            t.slots[s].devices[d].small_pool = pool + 1;
            pool
        }
    };
    let record = t.records.get(pool as usize).ok_or(Damaged)?;
    if record.state != RECORD_POOL {
        return Err(Damaged);
    }
    let mut head = record.head;
    if !t.take(device, slot, grow, &mut head)? {
        return Ok(false);
    }
    let record = &mut t.records[pool as usize];
    record.head = head;
    record.chunks = record.chunks.saturating_add(grow);
    let small = &mut t.slots[s].devices[d].chunks[Kind::Small as usize];
    *small = small.saturating_add(grow);
    Ok(true)
}

/// Releases live record `id` (validated by the caller).
pub fn release(t: &mut Tables<'_>, id: RecordId) {
    if try_release(t, id).is_err() {
        // The record was committed free first: rebuilding from the records finishes the job.
        repair(t);
    }
}

fn try_release(t: &mut Tables<'_>, id: RecordId) -> Result<(), Damaged> {
    let record = t.records[id as usize];
    t.records[id as usize].state = RECORD_FREE; // commits the release
    let (s, d) = (record.slot as usize, record.device as usize);
    if s >= t.slots.len() || d >= t.header.device_count as usize {
        return Err(Damaged);
    }
    let kind = Kind::from_u32(record.kind).ok_or(Damaged)?;
    t.give_back(record.device, record.head)?;
    let sd = &mut t.slots[s].devices[d];
    sd.bytes[kind as usize] = sd.bytes[kind as usize].saturating_sub(record.bytes);
    if kind == Kind::Small {
        shrink_small_pool(t, record.slot, record.device)?;
    } else {
        sd.chunks[kind as usize] = sd.chunks[kind as usize].saturating_sub(record.chunks);
    }
    if kind == Kind::Context && t.slots[s].devices[d].context == id + 1 {
        t.slots[s].devices[d].context = 0;
    }
    t.slots[s].frees = t.slots[s].frees.saturating_add(1);
    t.drop_record(id);
    Ok(())
}

/// Gives back the small pool's chunks beyond ceil(live small bytes / chunk), one at a time
/// (the pool only ever grows by single chunks).
fn shrink_small_pool(t: &mut Tables<'_>, slot: SlotId, device: u32) -> Result<(), Damaged> {
    let (s, d) = (slot as usize, device as usize);
    let chunk = t.chunk(device);
    let sd = t.slots[s].devices[d];
    let need = sd.bytes[Kind::Small as usize].div_ceil(chunk);
    let Some(pool) = sd.small_pool.checked_sub(1) else {
        return if sd.chunks[Kind::Small as usize] == 0 { Ok(()) } else { Err(Damaged) };
    };
    let mut held = sd.chunks[Kind::Small as usize];
    while held > need {
        let record = t.records.get(pool as usize).copied().ok_or(Damaged)?;
        if record.state != RECORD_POOL || record.head == 0 {
            return Err(Damaged);
        }
        // Detach the first block and free it alone.
        let (_, links) = t.device(d).ok_or(Damaged)?;
        let first = (record.head - 1) as usize;
        let link = *links.get(first).ok_or(Damaged)?;
        links[first] = link & 0xff;
        let freed = t.give_back(device, record.head)?;
        let record = &mut t.records[pool as usize];
        record.head = link >> 8;
        record.chunks = record.chunks.saturating_sub(freed);
        held = held.saturating_sub(freed);
    }
    t.slots[s].devices[d].chunks[Kind::Small as usize] = held;
    if held == 0 {
        t.records[pool as usize].state = RECORD_FREE;
        t.drop_record(pool);
        t.slots[s].devices[d].small_pool = 0;
    }
    Ok(())
}

/// Frees every record of `slot` and the slot; returns the chunks freed.
pub fn reclaim(t: &mut Tables<'_>, slot: SlotId) -> u64 {
    let before = t.state.devices.iter().fold(0u64, |sum, d| sum.saturating_add(d.used_chunks));
    let mut damaged = false;
    for id in 0..t.used_records() as RecordId {
        let record = t.records[id as usize];
        if record.slot != slot || record.state == RECORD_FREE {
            continue;
        }
        t.records[id as usize].state = RECORD_FREE;
        damaged |= t.give_back(record.device, record.head).is_err();
        t.drop_record(id);
    }
    t.slots[slot as usize] = zeroed_slot();
    if damaged {
        repair(t);
    }
    let after = t.state.devices.iter().fold(0u64, |sum, d| sum.saturating_add(d.used_chunks));
    before.saturating_sub(after)
}

/// Rebuilds every derived structure from the committed records: buddy spaces, block chains,
/// per-slot and per-device usage, small pools, the free-record list. Records that cannot be
/// valid (out-of-range slot, device or kind; a slot that is not live) are dropped.
pub fn repair(t: &mut Tables<'_>) {
    let count = t.header.device_count as usize;
    for d in 0..count {
        let cfg = t.header.devices[d];
        if let Some((words, links)) = t.device(d) {
            // The layout was validated at open; init can only fail on a geometry error.
            let _ = Buddy::init(words, cfg.limit, cfg.chunk);
            links.fill(0);
        }
        t.state.devices[d].used_chunks = 0;
    }
    for slot in t.slots.iter_mut() {
        if slot.state == SLOT_LIVE {
            slot.devices = [SlotDevice::default(); MAX_DEVICES];
        } else {
            *slot = zeroed_slot();
        }
    }
    // Live records first, in index order: allocations keep their place in the books.
    for id in 0..t.records.len() {
        let record = t.records[id];
        if record.state != RECORD_LIVE {
            t.records[id].state = RECORD_FREE; // small pools are rebuilt below
            continue;
        }
        let (s, d) = (record.slot as usize, record.device as usize);
        let kind = Kind::from_u32(record.kind);
        let slot_live = t.slots.get(s).is_some_and(|slot| slot.state == SLOT_LIVE);
        let valid = slot_live
            && d < count
            && match kind {
                Some(Kind::Small) => record.bytes < t.header.devices[d].chunk,
                Some(_) => true,
                None => false,
            };
        let Some(kind) = kind.filter(|_| valid) else {
            t.records[id].state = RECORD_FREE;
            continue;
        };
        let sd_bytes = record.bytes;
        let mut head = 0;
        let chunks = if kind == Kind::Small { 0 } else { t.chunks_for(record.device, record.bytes) };
        // A record the space cannot hold any more keeps its place with no blocks; check()
        // reports it. It is never dropped: what a workload allocated stays in the books.
        let placed = matches!(t.take(record.device, record.slot, chunks, &mut head), Ok(true));
        let record = &mut t.records[id];
        record.head = if placed { head } else { 0 };
        record.chunks = if placed { chunks } else { 0 };
        record.next_free = 0;
        let held = record.chunks;
        let sd = &mut t.slots[s].devices[d];
        sd.bytes[kind as usize] = sd.bytes[kind as usize].saturating_add(sd_bytes);
        if kind != Kind::Small {
            sd.chunks[kind as usize] = sd.chunks[kind as usize].saturating_add(held);
        }
        // The first context record of a slot is the one `Charge::Context` returns again.
        if kind == Kind::Context && sd.context == 0 {
            sd.context = id as u32 + 1;
        }
    }
    // Free list, then small pools (which take free records).
    t.state.free_record = 0;
    for id in (0..t.records.len()).rev() {
        if t.records[id].state == RECORD_FREE {
            t.drop_record(id as RecordId);
        }
    }
    for s in 0..t.slots.len() {
        if t.slots[s].state != SLOT_LIVE {
            continue;
        }
        for d in 0..count {
            let small = t.slots[s].devices[d].bytes[Kind::Small as usize];
            let grow = small.div_ceil(t.header.devices[d].chunk);
            for _ in 0..grow {
                if !matches!(grow_small_pool(t, s as SlotId, d as u32, 1), Ok(true)) {
                    break;
                }
            }
        }
    }
    t.state.slots_in_use = t.slots.iter().rposition(|s| s.state == SLOT_LIVE).map_or(0, |i| i as u32 + 1);
    t.state.records_in_use = t.records.iter().rposition(|r| r.state != RECORD_FREE).map_or(0, |i| i as u32 + 1);
    t.state.repairs = t.state.repairs.wrapping_add(1);
}

/// The derived state of a ledger just created, every byte of whose tables is zero (a new
/// file extended by `set_len`) but its records, which [`crate::file::write_free_records`]
/// wrote as the free list: with them, what [`repair`] makes of the zeroed file, byte for byte
/// (a test compares the two), without storing the zeros repair stores. So the slot table and
/// the block links, zero in a new ledger, are not written: their pages stay holes until a
/// process uses them (no page faults, no memory for them at creation). Written here: each
/// device's buddy words and the head of the free list.
pub fn fresh(t: &mut Tables<'_>) {
    for d in 0..t.header.device_count as usize {
        let cfg = t.header.devices[d];
        if let Some((words, _)) = t.device(d) {
            // The layout was validated at planning; init can only fail on a geometry error.
            let _ = Buddy::init(words, cfg.limit, cfg.chunk);
        }
    }
    t.state.free_record = u32::from(!t.records.is_empty());
    t.state.repairs = t.state.repairs.wrapping_add(1);
}

/// Every invariant of the ledger; returns the violations.
pub fn check(t: &mut Tables<'_>) -> Vec<String> {
    let mut problems = Vec::new();
    let count = t.header.device_count as usize;
    // Usage recomputed from the records.
    let mut usage = vec![[SlotDevice::default(); MAX_DEVICES]; t.slots.len()];
    let mut chained: Vec<HashSet<u64>> = vec![HashSet::new(); count];
    let mut device_chunks = vec![0u64; count];
    // The small-pool and context records of each (slot, device), which the slot links to.
    let mut pools: HashMap<(usize, usize), Vec<RecordId>> = HashMap::new();
    let mut contexts: HashMap<(usize, usize), Vec<RecordId>> = HashMap::new();
    for id in 0..t.records.len() {
        let record = t.records[id]; // a copy: the walk below borrows the tables
        if record.state == RECORD_FREE {
            continue;
        }
        let (s, d) = (record.slot as usize, record.device as usize);
        if record.state != RECORD_LIVE && record.state != RECORD_POOL {
            problems.push(format!("record {id}: unknown state {}", record.state));
            continue;
        }
        let Some(kind) = Kind::from_u32(record.kind) else {
            problems.push(format!("record {id}: unknown kind {}", record.kind));
            continue;
        };
        if record.state == RECORD_POOL && kind != Kind::Small {
            problems.push(format!("record {id}: a small pool of kind {}", kind.name()));
        }
        if s >= t.slots.len() || t.slots[s].state != SLOT_LIVE {
            problems.push(format!("record {id}: owner slot {s} is not live"));
            continue;
        }
        if d >= count {
            problems.push(format!("record {id}: device {d} out of range"));
            continue;
        }
        if record.state == RECORD_POOL {
            pools.entry((s, d)).or_default().push(id as RecordId);
        } else if kind == Kind::Context {
            contexts.entry((s, d)).or_default().push(id as RecordId);
        }
        let cfg = t.header.devices[d];
        // Walk the chain.
        let mut chunks = 0u64;
        let mut next = record.head;
        let (words, links) = t.device(d).unzip();
        let buddy = words.and_then(|w| Buddy::attach(w).ok());
        let links = links.as_deref();
        while next != 0 {
            let first = next - 1;
            let Some(link) = links.and_then(|l| l.get(first as usize)).copied() else {
                problems.push(format!("record {id}: chain leaves the device's chunks"));
                break;
            };
            if !chained[d].insert(first) {
                problems.push(format!("record {id}: block at chunk {first} is in two chains (or a cycle)"));
                break;
            }
            let order = (link & 0xff) as u32;
            let block = Block { offset: first * cfg.chunk, order, size: cfg.chunk << order.min(63) };
            if buddy.as_ref().and_then(|b| b.owner_of(&block)) != Some(record.slot) {
                problems.push(format!("record {id}: block at chunk {first} is not allocated to slot {s}"));
            }
            chunks = chunks.saturating_add(1u64 << order.min(63));
            next = link >> 8;
        }
        if chunks != record.chunks {
            problems.push(format!("record {id}: holds {chunks} chunks, says {}", record.chunks));
        }
        if record.state == RECORD_LIVE {
            let expected = match kind {
                Kind::Small => 0,
                _ => record.bytes.div_ceil(cfg.chunk),
            };
            if record.chunks != expected {
                problems.push(format!("record {id}: {} bytes should hold {expected} chunks, holds {}", record.bytes, record.chunks));
            }
            let bytes = &mut usage[s][d].bytes[kind as usize];
            *bytes = bytes.saturating_add(record.bytes);
        }
        if kind != Kind::Small || record.state == RECORD_POOL {
            let chunks = &mut usage[s][d].chunks[kind as usize];
            *chunks = chunks.saturating_add(record.chunks);
        }
        device_chunks[d] = device_chunks[d].saturating_add(record.chunks);
    }
    if let Some(beyond) = t.slots.iter().skip(t.state.slots_in_use as usize).position(|s| s.state != SLOT_FREE) {
        problems.push(format!("slot {} is in use beyond slots_in_use {}", beyond + t.state.slots_in_use as usize, t.state.slots_in_use));
    }
    if let Some(beyond) = t.records.iter().skip(t.state.records_in_use as usize).position(|r| r.state != RECORD_FREE) {
        problems.push(format!("record {} is in use beyond records_in_use {}", beyond + t.state.records_in_use as usize, t.state.records_in_use));
    }
    for (s, slot) in t.slots.iter().enumerate() {
        if slot.state != SLOT_LIVE {
            continue;
        }
        for (d, &want) in usage[s].iter().enumerate().take(count) {
            let have = slot.devices[d];
            if have.bytes != want.bytes || have.chunks != want.chunks {
                problems.push(format!("slot {s} device {d}: usage {:?}/{:?} but its records sum to {:?}/{:?}", have.bytes, have.chunks, want.bytes, want.chunks));
            }
            let small = want.bytes[Kind::Small as usize].div_ceil(t.header.devices[d].chunk);
            if want.chunks[Kind::Small as usize] != small {
                problems.push(format!("slot {s} device {d}: small pool holds {} chunks for {} live small bytes", want.chunks[Kind::Small as usize], want.bytes[Kind::Small as usize]));
            }
            // The slot's links to its pool and context (operations follow them). A slot may
            // hold several contexts (`Charge::AnotherContext`): its link is one of them or none.
            for (what, link, records) in [("small pool", have.small_pool, pools.get(&(s, d))), ("context", have.context, contexts.get(&(s, d)))] {
                match records.map(Vec::as_slice).unwrap_or_default() {
                    [] if link == 0 => {}
                    [one] if link == one + 1 => {}
                    [] => problems.push(format!("slot {s} device {d}: {what} link {link} but it has no {what} record")),
                    many if what == "context" && (link == 0 || many.contains(&(link - 1))) => {}
                    [one] => problems.push(format!("slot {s} device {d}: {what} link {link} but its {what} is record {one}")),
                    many => problems.push(format!("slot {s} device {d}: {} {what} records {many:?}", many.len())),
                }
            }
        }
    }
    for d in 0..count {
        let cfg = t.header.devices[d];
        let used = t.state.devices[d].used_chunks;
        if used != device_chunks[d] {
            problems.push(format!("device {d}: used {used} chunks but records hold {}", device_chunks[d]));
        }
        if used > cfg.chunks {
            problems.push(format!("device {d}: usage {} exceeds the limit {}", used.saturating_mul(cfg.chunk), cfg.limit));
        }
        let Some((words, _)) = t.device(d) else { continue };
        match Buddy::attach(words) {
            Err(error) => problems.push(format!("device {d}: buddy space: {error}")),
            Ok(buddy) => {
                if let Err(error) = buddy.check() {
                    problems.push(format!("device {d}: buddy space: {error}"));
                }
                let held = (cfg.limit - buddy.avail().min(cfg.limit)) / cfg.chunk;
                if held != device_chunks[d] {
                    problems.push(format!("device {d}: the buddy space holds {held} chunks, the records {}", device_chunks[d]));
                }
                for (block, owner) in buddy.allocated_blocks() {
                    if !chained[d].contains(&(block.offset / cfg.chunk)) {
                        problems.push(format!("device {d}: block at {} (slot {owner}) belongs to no record", block.offset));
                    }
                }
            }
        }
    }
    problems
}
