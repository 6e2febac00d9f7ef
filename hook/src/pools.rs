//! Memory pools whose reserved memory outlives the allocations in them: stream-ordered pools
//! (`cuMemAllocAsync`, `cuMemAllocFromPoolAsync`) and each device's graph memory pool (graph
//! memory nodes, see `graphs`). What such a pool costs the device is its reserved memory,
//! which freed allocations leave in place until the pool is trimmed, so that is what the
//! ledger is charged.
//!
//! Before an allocation that the pool's free part cannot cover, the worst-case growth (the
//! size rounded up to whole chunks) is admitted in the ledger; after the driver call, the
//! charge is settled to the pool's reserved memory as the driver reports it
//! (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`, `CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT`). Frees
//! and trims settle it again. A pool's charge is a stack of ledger records, released from the
//! top while the rest still covers what the pool holds.
//!
//! A pool can grow although its free part is large enough in sum: an allocation takes one
//! contiguous free range, so memory freed in pieces may not serve it (measured on an H200: a
//! PyTorch `cudaMallocAsync` job's pool grew by 64 MiB blocks with more than that free, past
//! its quota, until the probes stopped it). A growth of the call that the ledger cannot charge
//! (over quota) is given back: the allocation is freed on its stream (`cuMemFreeAsync`; the
//! application never sees it), and with the pools' lock released the stream is polled
//! (`cuStreamQuery`) for at most [`UNDO_WAIT`], then synchronized (`cuStreamSynchronize`: at
//! once if it is idle, else waiting for the work queued before; it is what makes the driver
//! take the freed block back, since a trim after the query alone released nothing on the
//! H200: `cuda.h` counts frees no synchronize observed as outstanding). Then the pool's free
//! part is given back to the driver (`cuMemPoolTrimTo(0)`, as `torch.cuda.empty_cache()`
//! does; to its charge if the synchronize failed). If that released more than the growth
//! (whole free chunks went back), the allocation is tried once more, the pool growing afresh
//! as an admitted growth; otherwise the caller gets `CUDA_ERROR_OUT_OF_MEMORY` and its
//! out-pointer cleared, as from a device of the quota's size (on the H200 the free pieces
//! shared the driver's chunks with live tensors and only the growth went back). The device
//! holds the growth from the call until then. Should the driver keep it anyway, the pool's
//! charge stays short, and of what it keeps free only the charged part serves an allocation
//! without an admission. The driver calls of this path run in the relaxed stream-capture mode,
//! so that another thread's capture is not broken. Only this path pays for any of it.
//!
//! A synchronize (`cuStreamSynchronize`, `cuEventSynchronize`, `cuCtxSynchronize`) gives a
//! pool's reserved memory above its release threshold back to the driver through no call
//! wrapped here, so before any admission of the process is refused, every pool charge is
//! settled to what its pool reports then ([`Pools::settle_all`]) and the admission tried once
//! more. Only the refusal path pays for those queries; a granted allocation makes none. The
//! synchronizes themselves are wrapped too (`exports`), and settle the same way after the
//! driver's call in a process that has charged a pool, so that the container's other
//! processes, which cannot settle this one's charges, are not refused against memory the
//! driver already took back.
//!
//! `cuMemPoolDestroy` ends a pool's charge as the driver ends its memory (measured on an H100,
//! driver 580.159: the free part goes back at once; what live allocations use stays until the
//! last of them is freed and that free has run). A pool with no live allocation releases its
//! whole charge at once. Otherwise the charge is *retired*: cut down to what its live
//! allocations need (each rounded up to whole chunks: the destroyed pool can no longer be
//! asked), kept while any of them lives (the driver releases the pool's resources once none
//! is outstanding), and released after the last one is freed, at once for
//! `cuMemFree_v2` and, for `cuMemFreeAsync`, once its stream has nothing left to run
//! (`cuStreamQuery`, asked then and at each later pool call of the process). A retired charge
//! is no longer filed under the pool's handle, so a new pool the driver gives the same handle
//! starts from nothing.
use std::{
    collections::HashMap,
    ffi::{c_int, c_void},
    sync::{
        atomic::{AtomicBool, Ordering},
        Mutex,
    },
    time::{Duration, Instant},
};

use cuda_abi::{
    CUdevice, CUmemoryPool, CUresult, CUstream, CUDA_SUCCESS, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT,
    CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, CUDA_ERROR_NOT_READY, CU_STREAM_CAPTURE_MODE_RELAXED};
use ledger::{Charge, RecordId, ReserveError};

use crate::{real::Driver, session::Session};

/// One pool's charge.
struct PoolCharge {
    device: u32,
    /// Records, oldest first, and the bytes each charges.
    records: Vec<(RecordId, u64)>,
    charged: u64,
}

/// This process's pools and which pool each live pool allocation came from.
#[derive(Default)]
pub struct Pools {
    state: Mutex<PoolState>,
    /// Whether this process has charged any pool yet (a synchronize in a process that has not
    /// takes no lock).
    used: AtomicBool,
}

#[derive(Default)]
struct PoolState {
    charges: HashMap<u64, PoolCharge>,
    /// Live pool allocation → its pool's charge, and its size.
    origin: HashMap<u64, (Owner, u64)>,
    /// Charges of destroyed pools that still had live allocations, by [`Owner::Retired`] id.
    retired: HashMap<u64, Retired>,
    next_retired: u64,
}

/// How long an allocation whose pool grew past the quota polls its stream for the free that
/// gives the growth back before it synchronizes the stream (waiting for what was queued).
pub const UNDO_WAIT: Duration = Duration::from_millis(200);

/// Whose charge a live pool allocation is part of.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Owner {
    /// A pool's, by [`Source::key`].
    Live(u64),
    /// A destroyed pool's.
    Retired(u64),
}

/// A destroyed pool's charge, kept while the driver still holds memory for it.
struct Retired {
    charge: PoolCharge,
    /// How many of its allocations are live.
    live: usize,
    /// After the last free, a `cuMemFreeAsync`'s stream (as an address) still to run it.
    draining: Option<usize>,
}

/// What an allocation through a pool came to.
pub enum PoolOutcome {
    /// The driver's result (the charge is settled).
    Called(CUresult),
    /// Refused before the driver was called: over quota.
    Refused,
    /// The driver allocated, but the pool grew past the quota: the allocation was freed again
    /// and is refused (the caller clears its out-pointer).
    GivenBack,
}

/// A pool: a stream-ordered one, or a device's graph memory pool (by driver ordinal).
#[derive(Clone, Copy)]
pub enum Source {
    Pool(CUmemoryPool),
    Graph(CUdevice),
}

impl Source {
    /// The key of its charge: pool handles are addresses, never the top of the address space.
    fn key(self) -> u64 {
        match self {
            Source::Pool(pool) => pool as u64,
            Source::Graph(ordinal) => u64::MAX - ordinal as u32 as u64,
        }
    }

    /// The pool whose charge has key `key` (see [`Source::key`]).
    fn from_key(key: u64) -> Source {
        match u64::MAX - key {
            ordinal if ordinal < ledger::layout::MAX_DEVICES as u64 => Source::Graph(ordinal as CUdevice),
            _ => Source::Pool(key as CUmemoryPool),
        }
    }

    fn reserved(self, driver: &Driver) -> Option<u64> {
        match self {
            Source::Pool(pool) => attribute(driver, pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT),
            Source::Graph(ordinal) => graph_attribute(driver, ordinal, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT),
        }
    }

    /// Asks the driver to give back what the pool keeps beyond `keep` bytes (a graph pool is
    /// left alone: only a launch grows it, and no launch is undone).
    fn trim_to(self, driver: &Driver, keep: u64) {
        if let (Source::Pool(pool), Some(trim)) = (self, driver.mem_pool_trim_to) {
            // SAFETY: a pool handle the driver gave the application; `keep` by value.
            let _ = unsafe { trim(pool, usize::try_from(keep).unwrap_or(usize::MAX)) };
        }
    }

    fn used(self, driver: &Driver) -> Option<u64> {
        match self {
            Source::Pool(pool) => attribute(driver, pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT),
            Source::Graph(ordinal) => graph_attribute(driver, ordinal, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT),
        }
    }
}

fn attribute(driver: &Driver, pool: CUmemoryPool, attr: i32) -> Option<u64> {
    let get = driver.mem_pool_get_attribute?;
    let mut value: u64 = 0;
    // SAFETY: for these attributes the driver writes one cuuint64_t to the live local.
    (unsafe { get(pool, attr, (&mut value as *mut u64).cast::<c_void>()) } == CUDA_SUCCESS).then_some(value)
}

fn graph_attribute(driver: &Driver, ordinal: CUdevice, attr: i32) -> Option<u64> {
    let get = driver.device_get_graph_mem_attribute?;
    let mut value: u64 = 0;
    // SAFETY: for these attributes the driver writes one cuuint64_t to the live local.
    (unsafe { get(ordinal, attr, (&mut value as *mut u64).cast::<c_void>()) } == CUDA_SUCCESS).then_some(value)
}

impl Pools {
    /// Admits, calls and settles an allocation of `size` bytes from `pool` on ledger
    /// `device`; `None` when the driver cannot report pool usage (the caller then charges
    /// the allocation by itself). `admit` is given the growth to charge and a way to settle
    /// every pool of this process (as [`Pools::settle_all`], under the lock held here), for
    /// its refusal path. `give_back` queues the free of an allocation `call` made on its
    /// stream and returns that stream as `cuStreamQuery` takes it; it is called when the call
    /// grew the pool past the quota (see the module doc); without it (a graph launch) such a
    /// growth stays, and is said. The pools' lock is released while a given-back growth's
    /// stream runs the free.
    #[allow(clippy::too_many_arguments)]
    pub fn allocate(
        &self,
        session: &Session,
        driver: &Driver,
        pool: Source,
        device: u32,
        size: u64,
        mut admit: impl FnMut(Charge, &mut dyn FnMut() -> bool) -> Option<RecordId>,
        mut call: impl FnMut() -> (CUresult, Option<u64>),
        mut give_back: Option<&mut dyn FnMut(u64) -> Option<usize>>,
    ) -> Option<PoolOutcome> {
        let chunk = session.ledger.header().devices[device as usize].chunk;
        let key = pool.key();
        self.used.store(true, Ordering::Relaxed);
        let mut guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        drain(session, driver, &mut guard);
        let mut tried_again = false;
        loop {
            let state = &mut *guard;
            // What the pool holds, read under the lock (another thread's allocation or trim
            // must not be taken for this one's growth).
            let (Some(reserved), Some(used)) = (pool.reserved(driver), pool.used(driver)) else {
                // A driver that cannot say: the caller charges the allocation by itself (a
                // retry's: refused, the given-back address cleared).
                return tried_again.then_some(PoolOutcome::GivenBack);
            };
            let charge = state.charges.entry(key).or_insert(PoolCharge { device, records: Vec::new(), charged: 0 });
            // Bring the charge up to what the pool holds now, then admit the worst-case growth
            // (on a refusal, this process's other pools are settled before it is final). Of
            // what a stream-ordered pool keeps free, only the charged part serves without an
            // admission: a pool still holding a growth it could not give back must not serve
            // an allocation that needs more than that part.
            let _ = settle_quietly(session, charge, reserved, chunk);
            let held = if matches!(pool, Source::Pool(_)) { reserved.min(charge.charged) } else { reserved };
            if size > held.saturating_sub(used) {
                let growth = size.div_ceil(chunk).saturating_mul(chunk);
                let Some(record) = admit(Charge::Device(growth), &mut || settle_every(session, driver, state)) else {
                    return Some(if tried_again { PoolOutcome::GivenBack } else { PoolOutcome::Refused });
                };
                let charge = state.charges.entry(key).or_insert(PoolCharge { device, records: Vec::new(), charged: 0 });
                charge.records.push((record, growth));
                charge.charged += growth;
            }
            let (result, address) = call();
            let after = pool.reserved(driver).unwrap_or(reserved);
            let charge = state.charges.entry(key).or_insert(PoolCharge { device, records: Vec::new(), charged: 0 });
            let mut short = settle_quietly(session, charge, after, chunk);
            if short.is_some() && settle_every_saying(session, driver, state, false) {
                // Other pools gave memory back at a synchronize: charge the rest now.
                let charge = state.charges.entry(key).or_insert(PoolCharge { device, records: Vec::new(), charged: 0 });
                short = settle_quietly(session, charge, after, chunk);
            }
            // Only a growth of this call that the quota cannot hold is given back.
            let over_quota = matches!(short, Some((_, ReserveError::OverQuota { .. }))) && after > reserved;
            let stream = match (result, address, give_back.as_mut()) {
                (CUDA_SUCCESS, Some(address), Some(give_back)) if over_quota => give_back(address),
                _ => None,
            };
            let Some(stream) = stream else {
                if let Some((missing, error)) = short {
                    say_uncharged(missing, &error);
                }
                if let (CUDA_SUCCESS, Some(address)) = (result, address) {
                    state.origin.insert(address, (Owner::Live(key), size));
                }
                return Some(match result {
                    // A retry's failure: the out-pointer may still hold the given-back address.
                    CUDA_SUCCESS => PoolOutcome::Called(result),
                    _ if tried_again => PoolOutcome::GivenBack,
                    _ => PoolOutcome::Called(result),
                });
            };
            // The free is queued on the caller's own stream. Without the lock (another
            // thread's work may need the pools): wait for the stream to run it, polling at
            // first, then synchronize it (at once if idle; it is what makes the driver take the
            // freed block back into the pool, measured on the H200). Then give the pool's free
            // part back.
            drop(guard);
            wait_idle(driver, stream, UNDO_WAIT);
            let synchronized = synchronized(driver, stream);
            guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
            let state = &mut *guard;
            let Some(charge) = state.charges.get_mut(&key) else {
                // The application destroyed the pool meanwhile: its charge ended with it.
                return Some(PoolOutcome::GivenBack);
            };
            let keep = if synchronized { 0 } else { charge.charged };
            relaxed(driver, || pool.trim_to(driver, keep));
            let (now, in_use) = (pool.reserved(driver), pool.used(driver));
            let short = now.and_then(|now| settle_quietly(session, charge, now, chunk));
            match (now, &short) {
                // The trim released more than the growth (whole free chunks went back): one more
                // try, growing the pool afresh.
                (Some(now), None) if synchronized && !tried_again && now < reserved => tried_again = true,
                _ => {
                    if let Some((missing, error)) = short {
                        say_uncharged(missing, &error);
                    }
                    refused_growth(device, size, now.unwrap_or(after), in_use.unwrap_or(used));
                    return Some(PoolOutcome::GivenBack);
                }
            }
        }
    }

    /// Whether `address` is a live pool allocation of this process.
    pub fn owns(&self, address: u64) -> bool {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).origin.contains_key(&address)
    }

    /// Calls the driver's free of pool allocation `address` (stream-ordered on `stream` for
    /// `cuMemFreeAsync`), then settles its pool, or its destroyed pool's retired charge.
    pub fn free(
        &self,
        session: &Session,
        driver: &Driver,
        address: u64,
        stream: Option<CUstream>,
        call: impl FnOnce() -> CUresult,
    ) -> CUresult {
        let mut guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let state = &mut *guard;
        let result = call();
        if result == CUDA_SUCCESS {
            match state.origin.remove(&address) {
                // Only stream-ordered pools hand out addresses that are freed one by one.
                Some((Owner::Live(key), _)) => settle_pool(session, driver, state, Source::Pool(key as CUmemoryPool)),
                Some((Owner::Retired(id), _)) => {
                    if let Some(retired) = state.retired.get_mut(&id) {
                        retired.live = retired.live.saturating_sub(1);
                        if retired.live > 0 {
                            // Not the last: the driver still holds what the destroy left.
                        } else if let (Some(stream), Some(_)) = (stream, driver.stream_query) {
                            // The last one, stream-ordered: the memory goes once this free has run.
                            retired.draining = Some(stream as usize);
                        } else {
                            release_all(session, &mut retired.charge);
                            state.retired.remove(&id);
                        }
                    }
                }
                None => {}
            }
            drain(session, driver, state);
        }
        result
    }

    /// Calls `cuMemPoolDestroy` and, if the driver destroyed `pool`, ends its charge: all of
    /// it at once with no live allocation from it, otherwise retired (see the module doc).
    pub fn destroy(&self, session: &Session, driver: &Driver, pool: CUmemoryPool, call: impl FnOnce() -> CUresult) -> CUresult {
        let mut guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let state = &mut *guard;
        let result = call();
        let key = Source::Pool(pool).key();
        if result != CUDA_SUCCESS {
            return result;
        }
        let Some(mut charge) = state.charges.remove(&key) else { return result };
        let chunk = session.ledger.header().devices[charge.device as usize].chunk;
        // The pool's live allocations pass to the retired charge (an unused id if none).
        state.next_retired += 1;
        let id = state.next_retired;
        let (mut live, mut needed) = (0, 0u64);
        for (owner, size) in state.origin.values_mut().filter(|(owner, _)| *owner == Owner::Live(key)) {
            *owner = Owner::Retired(id);
            live += 1;
            needed = needed.saturating_add(size.div_ceil(chunk).saturating_mul(chunk));
        }
        if live == 0 {
            release_all(session, &mut charge);
        } else {
            let target = needed.min(charge.charged);
            settle(session, &mut charge, target, chunk);
            state.retired.insert(id, Retired { charge, live, draining: None });
        }
        drain(session, driver, state);
        result
    }

    /// Settles every pool charge of this process to what the driver reports its pool holds
    /// now, and releases the retired charges whose memory is gone; whether that lowered what
    /// the process is charged. A synchronize (`cuStreamSynchronize`, `cuEventSynchronize`,
    /// `cuCtxSynchronize`) gives a pool's reserved memory above its release threshold back to
    /// the driver without any call the hook sees, so a refusal is final only after this (the
    /// refusal path of every admission calls it; granted allocations never do).
    pub fn settle_all(&self, session: &Session, driver: &Driver) -> bool {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        settle_every(session, driver, &mut state)
    }

    /// Calls a synchronize (`call`) and, if it succeeded in a process that has charged a
    /// pool, settles every pool charge ([`settle_every`]): the synchronize may have given
    /// pool memory back, and the container's other processes are refused against this
    /// ledger. A process without pool charges pays one atomic load. The settle is skipped
    /// when another thread holds the pools' lock (it may hold it across a driver call that
    /// blocks, e.g. a `cuMemFree` that synchronizes, or one waiting on work that waits for
    /// this thread): a synchronize never waits for the hook, and the refusal path settles
    /// anyway before any refusal is final.
    pub fn synchronize(&self, session: &Session, driver: &Driver, call: impl FnOnce() -> CUresult) -> CUresult {
        let result = call();
        if result == CUDA_SUCCESS && self.used.load(Ordering::Relaxed) {
            let state = match self.state.try_lock() {
                Ok(state) => Some(state),
                Err(std::sync::TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) => None,
            };
            if let Some(mut state) = state {
                settle_every(session, driver, &mut state);
            }
        }
        result
    }

    /// Calls `cuMemPoolTrimTo`, `cuDeviceGraphMemTrim` (or anything else that changes what
    /// `pool` holds), then settles.
    pub fn after(&self, session: &Session, driver: &Driver, pool: Source, call: impl FnOnce() -> CUresult) -> CUresult {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let result = call();
        settle_pool(session, driver, &mut state, pool);
        drain(session, driver, &mut state);
        result
    }
}

impl Pools {
    /// [`Pools::after`] for a pool this process may not have charged yet (a device's graph
    /// pool, grown by a launch the hook could not admit beforehand): its charge on ledger
    /// `device` starts here.
    pub fn settle_after(&self, session: &Session, driver: &Driver, pool: Source, device: u32, call: impl FnOnce() -> CUresult) -> CUresult {
        self.used.store(true, Ordering::Relaxed);
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let result = call();
        state.charges.entry(pool.key()).or_insert(PoolCharge { device, records: Vec::new(), charged: 0 });
        settle_pool(session, driver, &mut state, pool);
        result
    }
}

/// Releases the retired charges whose last free (a `cuMemFreeAsync`) has run: its stream is
/// idle (any answer but `CUDA_ERROR_NOT_READY`: a stream the application destroyed has run
/// its work).
fn drain(session: &Session, driver: &Driver, state: &mut PoolState) {
    state.retired.retain(|_, retired| {
        let Some(stream) = retired.draining else { return true };
        let done = idle(driver, stream);
        if done {
            release_all(session, &mut retired.charge);
        }
        !done
    });
}

/// [`Pools::settle_all`] with the lock held.
fn settle_every(session: &Session, driver: &Driver, state: &mut PoolState) -> bool {
    settle_every_saying(session, driver, state, true)
}

/// [`settle_every`], saying what the ledger could not charge if `say`.
fn settle_every_saying(session: &Session, driver: &Driver, state: &mut PoolState, say: bool) -> bool {
    let charged = |state: &PoolState| -> u64 {
        let live = state.charges.values().map(|c| c.charged);
        live.chain(state.retired.values().map(|r| r.charge.charged)).fold(0, u64::saturating_add)
    };
    let before = charged(state);
    drain(session, driver, state);
    for (key, charge) in &mut state.charges {
        if let Some(reserved) = Source::from_key(*key).reserved(driver) {
            let chunk = session.ledger.header().devices[charge.device as usize].chunk;
            let short = settle_quietly(session, charge, reserved, chunk);
            if let Some((missing, error)) = short.filter(|_| say) {
                say_uncharged(missing, &error);
            }
        }
    }
    charged(state) < before
}

/// Releases every record of `charge`.
fn release_all(session: &Session, charge: &mut PoolCharge) {
    for (record, _) in charge.records.drain(..) {
        let _ = session.ledger.release(session.slot, record);
    }
    charge.charged = 0;
}

fn settle_pool(session: &Session, driver: &Driver, state: &mut PoolState, pool: Source) {
    let Some(charge) = state.charges.get_mut(&pool.key()) else { return };
    let Some(reserved) = pool.reserved(driver) else { return };
    let chunk = session.ledger.header().devices[charge.device as usize].chunk;
    settle(session, charge, reserved, chunk);
}

/// [`settle_quietly`], saying what the ledger could not charge.
fn settle(session: &Session, charge: &mut PoolCharge, reserved: u64, chunk: u64) {
    if let Some((missing, error)) = settle_quietly(session, charge, reserved, chunk) {
        say_uncharged(missing, &error);
    }
}

fn say_uncharged(missing: u64, error: &ReserveError) {
    crate::session::say(&format!("a memory pool holds {missing} bytes more than the ledger could charge: {error}"));
}

/// Says, once a process, that an allocation was refused because its pool would grow past
/// the quota with the free part it keeps in pieces.
fn refused_growth(device: u32, size: u64, reserved: u64, used: u64) {
    static REPORTED: AtomicBool = AtomicBool::new(false);
    if !REPORTED.swap(true, Ordering::Relaxed) {
        crate::session::say(&format!(
            "GPU memory quota exceeded on device {device}: a memory pool would grow past it for {size} bytes \
             ({reserved} bytes reserved, {used} in use: what it keeps free is in pieces, none holds them); \
             returning CUDA_ERROR_OUT_OF_MEMORY"
        ));
    }
}

/// Whether `stream` (as an address) has run all its work: `cuStreamQuery` answers anything but
/// `CUDA_ERROR_NOT_READY` (a stream the application destroyed has run its work).
fn idle(driver: &Driver, stream: usize) -> bool {
    let Some(query) = driver.stream_query else { return true };
    // SAFETY: a stream handle the application passed to the driver (or the per-thread
    // stream's); the driver answers a destroyed one with an error code.
    relaxed(driver, || unsafe { query(stream as CUstream) }) != CUDA_ERROR_NOT_READY
}

/// `cuStreamSynchronize` of `stream` (as an address), in the relaxed capture mode; whether it
/// succeeded.
fn synchronized(driver: &Driver, stream: usize) -> bool {
    let Some(synchronize) = driver.stream_synchronize else { return true };
    // SAFETY: as in `idle`.
    relaxed(driver, || unsafe { synchronize(stream as CUstream) }) == CUDA_SUCCESS
}

/// Polls [`idle`] until the stream has run its work, for at most `wait`.
fn wait_idle(driver: &Driver, stream: usize, wait: Duration) {
    let deadline = Instant::now() + wait;
    while !idle(driver, stream) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_micros(250));
    }
}

/// Runs `f` with this thread's stream-capture mode relaxed (where the driver has
/// `cuThreadExchangeStreamCaptureMode`), so that its calls do not break another thread's
/// capture in the global mode.
pub fn relaxed<T>(driver: &Driver, f: impl FnOnce() -> T) -> T {
    let Some(exchange) = driver.thread_exchange_stream_capture_mode else { return f() };
    let mut mode: c_int = CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: the driver reads and writes one CUstreamCaptureMode through the live local.
    let swapped = unsafe { exchange(&mut mode) } == CUDA_SUCCESS;
    let out = f();
    if swapped {
        // SAFETY: as above; puts the thread's mode back.
        let _ = unsafe { exchange(&mut mode) };
    }
    out
}

/// Makes `charge` cover exactly the pool's `reserved` bytes (in whole chunks); what the
/// ledger could not charge of them, and why (`None`: all of it).
fn settle_quietly(session: &Session, charge: &mut PoolCharge, reserved: u64, chunk: u64) -> Option<(u64, ReserveError)> {
    let target = reserved.div_ceil(chunk).saturating_mul(chunk);
    while let Some(&(record, bytes)) = charge.records.last() {
        if charge.charged - bytes < target {
            break;
        }
        let _ = session.ledger.release(session.slot, record);
        charge.records.pop();
        charge.charged -= bytes;
    }
    // Records are as large as the growths they admitted: the top one is cut down to what is
    // still needed, replaced in one step under the ledger's lock (`Ledger::recharge`).
    let excess = charge.charged.saturating_sub(target);
    if let Some(&(record, bytes)) = charge.records.last().filter(|_| excess > 0) {
        if let Ok((smaller, kept)) = session.ledger.recharge(session.slot, session.identity, charge.device, Some(record), bytes - excess) {
            charge.records.pop();
            charge.records.extend(smaller.map(|smaller| (smaller, kept)));
            charge.charged = charge.charged - bytes + kept;
        }
    }
    if charge.charged < target {
        let missing = target - charge.charged;
        // The pool grew past what was admitted (the driver's rounding, or a free part in
        // pieces): keep the books true, or say how far they cannot be.
        match session.ledger.reserve(session.slot, charge.device, Charge::Device(missing), 0) {
            Ok(record) => {
                charge.records.push((record, missing));
                charge.charged += missing;
            }
            Err(error) => return Some((missing, error)),
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_charges_key_gives_back_its_pool() {
        let sources = [Source::Graph(0), Source::Graph(15), Source::Pool(0x5ca3_0000_1000 as CUmemoryPool), Source::Pool(std::ptr::null_mut())];
        for source in sources {
            let again = Source::from_key(source.key());
            assert_eq!(again.key(), source.key());
            assert_eq!(matches!(again, Source::Graph(_)), matches!(source, Source::Graph(_)));
        }
    }
}
