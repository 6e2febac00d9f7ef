//! This process's enforcement state: its ledger and slot, the allocations it made (pointer
//! or handle → ledger record), and the life-cycle around them: set up on the first CUDA call
//! that needs it, a fresh slot in a forked child, the slot released at normal exit.
//!
//! The fast path takes no process-wide lock: the session is reached through an atomic
//! pointer, and the allocation map is sharded by address.
//!
//! What a workload is shown of a device with a quota comes from here too: [`Session::quota`]
//! for a driver ordinal's ledger device, [`quota_by_uuid`] for a GPU that NVML names by its
//! UUID (also in a process that has not initialised the driver, from the container's ledger).
use std::{
    collections::HashMap,
    ffi::c_int,
    os::unix::fs::OpenOptionsExt as _,
    sync::{
        atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering},
        Mutex,
    },
};

use cuda_abi::{gpu_uuid_text, CUdevice, CUuuid, CUDA_SUCCESS};
use ledger::{
    layout::{Header, CREATOR_HOOK, MAX_DEVICES},
    DeviceConfig, Geometry, Ledger, ProcessIdentity, RecordId, SlotId,
};

use crate::{config::Config, real};

/// Slots and records of a ledger the hook creates.
const SLOTS: u32 = ledger::layout::CONTAINER_SLOTS;
const RECORDS: u32 = ledger::layout::CONTAINER_RECORDS;
const SHARDS: usize = 64;

/// Where an allocation's identifier lives: device pointers and handles of other kinds can
/// collide.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Space {
    Pointer,
    /// CUDA arrays (`CUarray`).
    Array,
    /// Mipmapped arrays (`CUmipmappedArray`).
    Mipmap,
}

/// The allocations one shard of the map knows: (space, pointer or handle) -> (ledger device,
/// record).
type Charges = HashMap<(Space, u64), (u32, RecordId)>;

/// What the hook does for this process.
#[allow(clippy::large_enum_variant)] // one value per process, never moved after set-up
pub enum Mode {
    /// No quota anywhere and no ledger: every call goes straight to the driver.
    PassThrough,
    /// The ledger cannot be used and the policy is to refuse allocations.
    Refuse(String),
    Enforce(Session),
}

pub struct Session {
    pub ledger: Ledger,
    pub slot: SlotId,
    /// Ledger device of each driver ordinal (None: not in the ledger, not enforced).
    devices: [Option<u32>; MAX_DEVICES],
    /// Ordinals not in the ledger whose allocations are refused (not fail-open).
    refused: [bool; MAX_DEVICES],
    /// The driver's UUID of each ordinal (zero where it did not say).
    uuids: [[u8; 16]; MAX_DEVICES],
    /// Charges of the stream-ordered pools and graph pools this process allocates from.
    pub pools: crate::pools::Pools,
    /// The VMM handles, contexts and graphs this process holds (see those modules).
    pub vmm: crate::vmm::Vmm,
    pub contexts: crate::contexts::Contexts,
    pub graphs: crate::graphs::Graphs,
    allocations: [Mutex<Charges>; SHARDS],
    /// This process as its slot records it.
    pub identity: ProcessIdentity,
}

impl Session {
    /// The ledger device of driver ordinal `ordinal`, if it is enforced.
    pub fn ledger_device(&self, ordinal: CUdevice) -> Option<u32> {
        usize::try_from(ordinal).ok().and_then(|i| self.devices.get(i).copied().flatten())
    }

    /// Whether allocations on driver ordinal `ordinal`, a GPU the ledger does not know, are
    /// refused (said once at set-up; not with `VRAMGUARD_FAIL_OPEN=1`, outside a provisioned
    /// container).
    pub fn refuses(&self, ordinal: CUdevice) -> bool {
        usize::try_from(ordinal).ok().is_some_and(|i| self.refused.get(i).copied().unwrap_or(false))
    }

    /// The enforced ledger device of the GPU whose UUID NVML writes as `uuid` (`GPU-…`): the
    /// ledger device of that UUID or, in a ledger that knows no UUIDs, the one of the driver
    /// ordinal with that UUID.
    pub fn ledger_device_by_uuid(&self, uuid: &str) -> Option<u32> {
        ledger_device_named(self.ledger.header(), uuid).or_else(|| {
            let ordinal = self.uuids.iter().position(|u| *u != [0; 16] && gpu_uuid_text(u).eq_ignore_ascii_case(uuid))?;
            self.devices.get(ordinal).copied().flatten()
        })
    }

    /// (quota, bytes in use by the container) of ledger device `device`.
    pub fn quota(&self, device: u32) -> Option<(u64, u64)> {
        quota_in(&self.ledger, device)
    }

    /// Remembers that `record` on `device` belongs to `(space, address)`.
    pub fn remember(&self, space: Space, address: u64, device: u32, record: RecordId) {
        self.shard(address).lock().unwrap_or_else(|p| p.into_inner()).insert((space, address), (device, record));
    }

    /// Forgets `(space, address)`; returns its record, if the hook charged it.
    pub fn forget(&self, space: Space, address: u64) -> Option<(u32, RecordId)> {
        self.shard(address).lock().unwrap_or_else(|p| p.into_inner()).remove(&(space, address))
    }

    /// Puts back what [`Session::forget`] took (the driver refused the free).
    pub fn restore(&self, space: Space, address: u64, entry: (u32, RecordId)) {
        self.remember(space, address, entry.0, entry.1);
    }

    fn shard(&self, address: u64) -> &Mutex<Charges> {
        // Addresses are at least 256-aligned: mix the bits above that.
        let index = ((address >> 8) ^ (address >> 21)) as usize % SHARDS;
        &self.allocations[index]
    }

}

/// The mode while the driver is not initialised (no `cuInit` yet): nothing to enforce on.
static NOT_YET: Mode = Mode::PassThrough;

static CURRENT: AtomicPtr<Mode> = AtomicPtr::new(std::ptr::null_mut());
static CURRENT_GENERATION: AtomicU64 = AtomicU64::new(u64::MAX);
static FORK_GENERATION: AtomicU64 = AtomicU64::new(0);

/// The turn to set this process's mode up. Not a mutex: a child forked while another thread
/// holds it would wait forever for a thread it does not have, so the child's fork handler
/// frees it (the child has one thread, which was forking, not setting up).
static SETUP: AtomicBool = AtomicBool::new(false);

/// Holds [`SETUP`] until dropped.
struct SetupTurn;

impl SetupTurn {
    fn take() -> SetupTurn {
        let mut spins = 0u32;
        while SETUP.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
            // Set-up happens once per process and takes milliseconds: wait politely.
            spins += 1;
            if spins < 100 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        SetupTurn
    }
}

impl Drop for SetupTurn {
    fn drop(&mut self) {
        SETUP.store(false, Ordering::Release);
    }
}

/// Registered when the library is loaded, before any thread can take a lock of the hook's:
/// the fork handler and the release of this process's slot at exit.
#[used]
#[link_section = ".init_array"]
static AT_LOAD: extern "C" fn() = at_load;

extern "C" fn at_load() {
    // SAFETY: registering plain extern "C" handlers with no arguments, which live as long as
    // the process (the library is preloaded, never unloaded).
    unsafe {
        libc::pthread_atfork(None, Some(after_fork_in_parent), Some(after_fork_in_child));
        libc::atexit(release_at_exit);
    }
}

/// This process's mode, set up on first use (and again in a forked child).
pub fn mode() -> &'static Mode {
    let generation = FORK_GENERATION.load(Ordering::Acquire);
    let current = CURRENT.load(Ordering::Acquire);
    if !current.is_null() && CURRENT_GENERATION.load(Ordering::Acquire) == generation {
        // SAFETY: modes are leaked boxes, never freed; the pointer stays valid forever.
        return unsafe { &*current };
    }
    let _turn = SetupTurn::take();
    let current = CURRENT.load(Ordering::Acquire);
    if !current.is_null() && CURRENT_GENERATION.load(Ordering::Acquire) == generation {
        // SAFETY: as above.
        return unsafe { &*current };
    }
    let Some(mode) = set_up() else {
        // The driver is not initialised yet (no cuInit): nothing to enforce on, decide later.
        return &NOT_YET;
    };
    let mode: &'static Mode = Box::leak(Box::new(mode));
    CURRENT.store((mode as *const Mode).cast_mut(), Ordering::Release);
    CURRENT_GENERATION.store(generation, Ordering::Release);
    mode
}

/// (quota, bytes in use by the container) of the enforced ledger device that is the GPU NVML
/// names `uuid` (`GPU-…`); `None` where nothing is enforced on it.
///
/// NVML works without `cuInit` (`nvidia-smi` never calls it, nor loads libcuda): in a process
/// whose driver is not loaded or not initialised yet, the container's ledger is read as it
/// is, if it exists, and the GPU found by its UUID there (reading takes no slot). Before any
/// process of the container has created the ledger, nothing is charged and NVML's own numbers
/// are shown.
pub fn quota_by_uuid(uuid: &str) -> Option<(u64, u64)> {
    if !real::driver_loaded() {
        return quota_without_driver(uuid);
    }
    let mode = mode();
    match mode {
        Mode::Enforce(session) => session.quota(session.ledger_device_by_uuid(uuid)?),
        Mode::PassThrough if std::ptr::eq(mode, &NOT_YET) => quota_without_driver(uuid),
        Mode::PassThrough | Mode::Refuse(_) => None,
    }
}

/// [`quota_by_uuid`] from the container's ledger as it is, without a session.
fn quota_without_driver(uuid: &str) -> Option<(u64, u64)> {
    let config = Config::from_env().ok()?;
    let ledger = open_ledger(&config, None).ok()?;
    quota_in(&ledger, ledger_device_named(ledger.header(), uuid)?)
}

/// The ledger device whose UUID NVML writes as `uuid`.
fn ledger_device_named(header: &Header, uuid: &str) -> Option<u32> {
    let devices = header.devices.get(..header.device_count as usize)?;
    let index = devices.iter().position(|d| d.uuid != [0; 16] && gpu_uuid_text(&d.uuid).eq_ignore_ascii_case(uuid))?;
    u32::try_from(index).ok()
}

/// (quota, bytes in use) of ledger device `device`.
fn quota_in(ledger: &Ledger, device: u32) -> Option<(u64, u64)> {
    let config = ledger.header().devices.get(device as usize)?;
    let usage = ledger.device_usage().ok()?;
    Some((config.limit, usage.get(device as usize)?.used_chunks.saturating_mul(config.chunk)))
}

extern "C" fn after_fork_in_parent() {
    // The child shares this process's open device files: the driver keeps this process's
    // memory while the child holds them, even after this process exits, so its slot says so
    // (one atomic OR in the mapped slot; see `ledger::layout::SLOT_FORKED`).
    let current = CURRENT.load(Ordering::Acquire);
    if current.is_null() {
        return;
    }
    // SAFETY: modes are leaked, never freed.
    if let Mode::Enforce(session) = unsafe { &*current } {
        if session.identity.pid == std::process::id() {
            session.ledger.mark_forked(session.slot);
        }
    }
}

extern "C" fn after_fork_in_child() {
    // The child's CUDA state is not the parent's: it gets its own slot on first use. A turn
    // to set up that another thread of the parent held is nobody's in the child.
    FORK_GENERATION.fetch_add(1, Ordering::AcqRel);
    SETUP.store(false, Ordering::Release);
}

extern "C" fn release_at_exit() {
    let current = CURRENT.load(Ordering::Acquire);
    if current.is_null() {
        return;
    }
    // SAFETY: modes are leaked, never freed.
    if let Mode::Enforce(session) = unsafe { &*current } {
        if session.identity.pid == std::process::id() {
            let _ = session.ledger.reclaim(session.slot);
        }
    }
}

/// The mode for this process, or `None` while the driver is not initialised.
fn set_up() -> Option<Mode> {
    let config = match Config::from_env() {
        Ok(config) => config,
        Err(error) => {
            // An unusable setting is a problem like an unusable ledger: fail-open (if that
            // setting itself is usable) runs without limits, except in a provisioned container.
            let problem = format!("bad setting: {error}");
            let provisioned = provisioned_container();
            return Some(if !provisioned && crate::config::fail_open_asked() { pass(problem) } else { refuse(problem, provisioned) });
        }
    };
    if !config.has_limits() && !config.ledger.exists() {
        return Some(Mode::PassThrough);
    }
    match open_session(&config) {
        Ok(session) => Some(Mode::Enforce(session)),
        Err(SetupError::NotInitialised) => None,
        Err(SetupError::Failed(error)) => {
            let problem = format!("cannot use the ledger {}: {error}", config.ledger.display());
            Some(if config.fail_open { pass(problem) } else { refuse(problem, config.provisioned.is_some()) })
        }
    }
}

enum SetupError {
    NotInitialised,
    Failed(String),
}

impl From<String> for SetupError {
    fn from(error: String) -> Self {
        SetupError::Failed(error)
    }
}

/// Runs without limits, said once.
fn pass(problem: String) -> Mode {
    say(&format!("{problem}; VRAMGUARD_FAIL_OPEN=1: running WITHOUT GPU memory limits"));
    Mode::PassThrough
}

/// Refuses every allocation, said once (with the way out, except in a provisioned container,
/// which has none: its quota is the operator's).
fn refuse(problem: String, provisioned: bool) -> Mode {
    if provisioned {
        say(&format!("{problem}; refusing GPU allocations (this container's quota is provisioned by the node's vramguard agent)"));
    } else {
        say(&format!("{problem}; refusing GPU allocations (set VRAMGUARD_FAIL_OPEN=1 to run without limits instead)"));
    }
    Mode::Refuse(problem)
}

/// Whether the agent's limits are mounted here (see [`crate::config`]).
fn provisioned_container() -> bool {
    std::path::Path::new(ledger::provisioned::LIMITS).exists()
}

/// One line on stderr, prefixed, in one `write` (not through Rust's stderr, whose lock a
/// thread of a forking parent may hold).
pub fn say(message: &str) {
    let line = format!("vramguard: {message}\n");
    let mut rest = line.as_bytes();
    while !rest.is_empty() {
        // SAFETY: writes bytes of a live buffer to the standard error descriptor.
        let written = unsafe { libc::write(libc::STDERR_FILENO, rest.as_ptr().cast(), rest.len()) };
        match usize::try_from(written) {
            Ok(n) if n > 0 => rest = &rest[n..],
            _ if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted => {}
            _ => return,
        }
    }
}

fn open_session(config: &Config) -> Result<Session, SetupError> {
    let driver = real::driver().map_err(Clone::clone)?;
    let count = device_count(driver)?;
    let uuids: Vec<[u8; 16]> = (0..count).map(|ordinal| device_uuid(driver, ordinal)).collect();
    let geometry = Geometry {
        slots: SLOTS,
        records: RECORDS,
        devices: (0..count)
            .map(|ordinal| DeviceConfig {
                uuid: uuids[ordinal as usize],
                // A device without a quota is limited by what it has.
                limit: config.limits[ordinal as usize].unwrap_or_else(|| device_total(driver, ordinal)),
                chunk: crate::config::CHUNK,
                context_reserve: config.context_reserve,
                ..Default::default()
            })
            .collect(),
    };
    let ledger = open_ledger(config, Some(&geometry))?;
    // The downward API's names, for the agent's labels (written once: the ledger keeps the
    // same names untouched). Informational only, so a failure here stops nothing. A
    // provisioned container's names are the agent's (from the runtime), not written here.
    if config.provisioned.is_none() {
        if let Err(error) = ledger.set_names(&config.names) {
            say(&format!("cannot record the container's names in {}: {error}", config.ledger.display()));
        }
    }
    let header = *ledger.header();
    let mut devices = [None; MAX_DEVICES];
    let mut ordinal_uuids = [[0; 16]; MAX_DEVICES];
    for ordinal in 0..count.min(MAX_DEVICES as c_int) {
        let uuid = uuids[ordinal as usize];
        ordinal_uuids[ordinal as usize] = uuid;
        // A ledger that knows device UUIDs maps them (CUDA_VISIBLE_DEVICES may reorder or
        // hide devices); otherwise visible ordinal i is ledger device i, as HAMi's limits.
        let by_uuid = (uuid != [0; 16])
            .then(|| header.devices[..header.device_count as usize].iter().position(|d| d.uuid == uuid))
            .flatten();
        let known_uuids = header.devices[..header.device_count as usize].iter().any(|d| d.uuid != [0; 16]);
        devices[ordinal as usize] = match by_uuid {
            Some(index) => Some(index as u32),
            None if !known_uuids && (ordinal as u32) < header.device_count => Some(ordinal as u32),
            None => None,
        };
    }
    let missing: Vec<c_int> = (0..count.min(MAX_DEVICES as c_int)).filter(|&o| devices[o as usize].is_none()).collect();
    let refused = unknown_devices(config, &header, &missing, &ordinal_uuids);
    let identity = ProcessIdentity::current().map_err(|e| format!("cannot read this process's identity: {e}"))?;
    // Slots of processes that died without a word go first (the agent does this too).
    let _ = ledger.reclaim_dead();
    let slot = ledger.register(identity).map_err(|e| e.to_string())?;
    Ok(Session {
        ledger,
        slot,
        devices,
        refused,
        uuids: ordinal_uuids,
        pools: Default::default(),
        vmm: Default::default(),
        contexts: Default::default(),
        graphs: Default::default(),
        allocations: std::array::from_fn(|_| Mutex::new(HashMap::new())),
        identity,
    })
}

/// Says which visible GPUs (`missing` ordinals) the ledger does not know, in one line, and
/// returns the ordinals whose allocations are refused: all of them, unless fail-open outside a
/// provisioned container (then none, said too).
fn unknown_devices(config: &Config, header: &Header, missing: &[c_int], uuids: &[[u8; 16]; MAX_DEVICES]) -> [bool; MAX_DEVICES] {
    let mut refused = [false; MAX_DEVICES];
    if missing.is_empty() {
        return refused;
    }
    let named: Vec<String> = missing
        .iter()
        .map(|&o| match uuids[o as usize] {
            uuid if uuid == [0; 16] => format!("GPU {o}"),
            uuid => format!("GPU {o} ({})", gpu_uuid_text(&uuid)),
        })
        .collect();
    let problem = format!(
        "{} not in the ledger {} (it has {} device(s))",
        if named.len() == 1 { format!("{} is", named[0]) } else { format!("{} are", named.join(", ")) },
        config.ledger.display(),
        header.device_count
    );
    if config.fail_open && config.provisioned.is_none() {
        say(&format!("{problem}; VRAMGUARD_FAIL_OPEN=1: running WITHOUT GPU memory limits there"));
        return refused;
    }
    let why = if config.provisioned.is_some() {
        "this container's quota is provisioned by the node's vramguard agent"
    } else {
        "set VRAMGUARD_FAIL_OPEN=1 to run without limits there instead"
    };
    say(&format!("{problem}; refusing GPU allocations there ({why})"));
    for &o in missing {
        refused[o as usize] = true;
    }
    refused
}

/// The ledger `config` names: a provisioned container's, mapped with the agent's header; else
/// the file at the path, created with `geometry` when there is none and one is given.
fn open_ledger(config: &Config, geometry: Option<&Geometry>) -> Result<Ledger, String> {
    let path = &config.ledger;
    let ledger = match (&config.provisioned, geometry) {
        (Some(header), _) => std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
            .map_err(|error| ledger::LedgerError::Io { path: path.clone(), source: error })
            .and_then(|file| Ledger::from_file_as(&file, *header, path)),
        (None, Some(geometry)) => Ledger::open_or_create(path, geometry, CREATOR_HOOK),
        (None, None) => Ledger::open(path),
    };
    ledger.map_err(|error| error.to_string())
}

fn device_count(driver: &real::Driver) -> Result<c_int, SetupError> {
    let get = driver.device_get_count.ok_or_else(|| "the driver has no cuDeviceGetCount".to_string())?;
    let mut count: c_int = 0;
    // SAFETY: the out-pointer is a live local.
    match unsafe { get(&mut count) } {
        CUDA_SUCCESS => Ok(count.clamp(0, MAX_DEVICES as c_int)),
        cuda_abi::CUDA_ERROR_NOT_INITIALIZED => Err(SetupError::NotInitialised),
        other => Err(format!("cuDeviceGetCount failed ({other})").into()),
    }
}

/// The device's memory as the driver reports it (the ledger's limit for a device without a
/// quota); 1 TiB if the driver cannot say.
fn device_total(driver: &real::Driver, ordinal: c_int) -> u64 {
    const FALLBACK: u64 = 1 << 40;
    let Some(get) = driver.device_total_mem else { return FALLBACK };
    let mut bytes: usize = 0;
    // SAFETY: the out-pointer is a live local.
    match unsafe { get(&mut bytes, ordinal) } {
        CUDA_SUCCESS if bytes > 0 => bytes as u64,
        _ => FALLBACK,
    }
}

fn device_uuid(driver: &real::Driver, ordinal: c_int) -> [u8; 16] {
    let Some(get) = driver.device_get_uuid else { return [0; 16] };
    let mut uuid = CUuuid { bytes: [0; 16] };
    // SAFETY: the out-pointer is a live local.
    if unsafe { get(&mut uuid, ordinal) } != CUDA_SUCCESS {
        return [0; 16];
    }
    uuid.bytes.map(|b| u8::from_ne_bytes(b.to_ne_bytes())) // c_char: i8 or u8 by target
}
