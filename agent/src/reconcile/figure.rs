//! One figure per process, and summed per container: what a process holds on its GPUs from
//! the three views ([`figure`]), taken as of one driver read; what its stream-ordered pools
//! may still keep of what the probes saw freed ([`PoolsKeep`]); and the two-read
//! confirmation a figure needs before anything acts on it ([`Confirmed`], and [`Agreed`] for
//! one that must not fall on one read).
//!
//! # The views, on one scale
//!
//! Each view is put on the probes' scale, which never counts a context: bytes beyond one
//! context per device.
//!
//! * The probes: live bytes (the largest figure they gave since a read interval before the
//!   driver's read started: what they counted while the driver read), plus what the process's
//!   pools may keep of what the probes saw freed into them ([`PoolsKeep`]): a pool whose
//!   release threshold keeps what it frees (PyTorch's `cudaMallocAsync` backend, RMM) still
//!   holds it, the driver reports it, and the next allocation from the pool takes it back
//!   without the driver holding more.
//! * The ledger: its slot's requested bytes (data, small, managed; arrays, graph memory and
//!   pools included, which the hook charges as data) and the context records beyond the first
//!   on each device (a second context on one device is real memory the hook charges).
//! * The driver: NVML's figure less a context at `--context-allowance` and a 2 MiB page per
//!   device ([`Figure::held`], [`Figure::outside`]); for what the ledger is charged (once the
//!   driver's figure is beyond that too), less its ledger's context reserve (never more than
//!   the allowance) where it has one.
//!
//! A process holds the larger of the three ([`Figure::held`]): never one view's live counter
//! plus another view's old difference. A container holds the sum over its processes.
//!
//! # What each figure is for
//!
//! * [`Figure::outside`]: what the driver says the process holds beyond what the probes
//!   explain (live and pool-kept). The ledger explains none of it away (the tenant writes the
//!   ledger). Under `--enforce audit` it comes off the limit the probes check, once
//!   [`Confirmed`] on two driver reads.
//! * [`Figure::unexplained`]: what neither the probes nor the ledger explain: the process's
//!   `unprobed` state and its container's charge, once confirmed too.
//! * [`at_read`]: what the process holds as of one read, all of it on the probes' scale: its
//!   part of its cgroup's usage against the limit, and, beyond what its ledger charges, what
//!   makes it the first to be stopped when the cgroup is over (both once confirmed).
use std::time::Instant;

/// What a device rounds a process's memory up to beyond its allocations: one 2 MiB page.
pub const DRIVER_PAGE: u64 = 2 << 20;

/// What a process's ledger slot says.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LedgerView {
    /// Requested bytes it charges (data, small, managed).
    pub bytes: u64,
    /// Bytes of its context records beyond the first on each device (the hook charges the
    /// reserve for every context).
    pub extra_contexts: u64,
    /// Its ledger's context reserve per device.
    pub reserve: u64,
}

/// What the driver reports of a process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DriverView {
    /// Bytes over its devices, contexts included.
    pub bytes: u64,
    /// Devices it holds memory on.
    pub devices: u32,
}

/// The three views of one process, as of one driver read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Views {
    /// Live bytes the probes count (as of the read: see the module doc).
    pub probes: u64,
    /// Bytes its pools may keep of what the probes saw freed ([`PoolsKeep::kept`]).
    pub pool_kept: u64,
    pub ledger: Option<LedgerView>,
    pub driver: Option<DriverView>,
}

/// What a process holds, from [`figure`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Figure {
    /// The larger of what each view says, contexts aside (a context per device at the
    /// allowance, and the ledger's first context on each device).
    pub held: u64,
    /// Of the driver's figure, the bytes beyond the probes' (live and pool-kept), a context per
    /// device at the allowance and a page aside.
    pub outside: u64,
    /// Of the driver's figure, the bytes neither the probes nor the ledger explain, when they
    /// are beyond a context at the allowance and a page per device: all of it beyond what
    /// they explain, contexts included, except the contexts its ledger charges (its reserve,
    /// at most the allowance). 0 otherwise.
    pub unexplained: u64,
}

/// The one figure of a process from its three views (see the module doc); `allowance` is
/// `--context-allowance`.
pub fn figure(views: &Views, allowance: u64) -> Figure {
    let probes = views.probes.saturating_add(views.pool_kept);
    let ledger = views.ledger.map_or(0, |l| l.bytes.saturating_add(l.extra_contexts));
    let Some(driver) = views.driver else {
        return Figure { held: probes.max(ledger), outside: 0, unexplained: 0 };
    };
    let devices = u64::from(driver.devices);
    let on_scale = on_scale(driver, allowance);
    let outside = on_scale.saturating_sub(probes);
    // What a process holds on a device beyond its allocations, its context and what comes
    // with it (module images, local memory, the device heap), is what the operator allows
    // (`--context-allowance`), for a hooked process as for any other. Its ledger's reserve is
    // the bare context the hook charges: were it the tolerance, every honest job that loaded
    // kernels would be `unprobed` (a PyTorch job on an H200 held 70 MiB beyond its 518 MiB
    // context, docs/gpu.md). Once beyond it, only the contexts the ledger charges are taken
    // off, and never more than the allowance each: a workload that made its own ledger chose
    // that reserve, and must not explain memory away with it.
    let reserve = views.ledger.map_or(0, |l| l.reserve.min(allowance));
    let explained = probes.max(ledger);
    let contexts = devices.saturating_mul(allowance.saturating_add(DRIVER_PAGE));
    let unexplained = if driver.bytes <= explained.saturating_add(contexts) {
        0
    } else {
        let charged_contexts = devices.saturating_mul(reserve);
        driver.bytes.saturating_sub(explained).saturating_sub(charged_contexts).max(1)
    };
    Figure { held: probes.max(ledger).max(on_scale), outside, unexplained }
}

/// The driver's figure of a process on the probes' scale: less a context at `allowance` and a
/// page per device.
fn on_scale(driver: DriverView, allowance: u64) -> u64 {
    driver.bytes.saturating_sub(u64::from(driver.devices).saturating_mul(allowance.saturating_add(DRIVER_PAGE)))
}

/// What a process holds as of one driver read, for its cgroup's usage against the limit: the
/// driver's figure on the probes' scale (all it holds there: live, kept by its pools, memory
/// the probes cannot see), never less than the probes' live bytes at the read (`probes_low`:
/// the smallest they gave since a read interval before it started); without the driver's row
/// (NVML lists only processes that own a channel), those live bytes. One read's figures only:
/// never one view's live counter beside another view's older one, so memory a pool gave back
/// at a synchronize no probe saw, or trimmed, is gone from it at the first read after.
pub fn at_read(probes_low: u64, driver: Option<DriverView>, allowance: u64) -> u64 {
    driver.map_or(probes_low, |driver| on_scale(driver, allowance).max(probes_low))
}

/// What a process's stream-ordered pools may still keep of what the probes saw freed into
/// them, held to what the driver says.
///
/// The probes count it (`pool_kept` of their process entry: each free of a stream-ordered
/// allocation adds its size, each new one takes its size off, as a pool serves it from what
/// it keeps first). That is an upper bound: a pool whose release threshold is low gives its
/// memory back to the driver at a synchronize, which no probe sees. The driver's figure says
/// so: a read that started after the probes' figure last changed, and shows the process
/// holding less beyond the probes' live bytes than the pools would keep, lowers what they
/// keep to that for good (until the probes' figure falls below it). A pool that keeps what
/// it frees is thus counted once, as the driver holds it; memory given back and taken again
/// through a copy of libcuda no probe is on is not explained by it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolsKeep {
    /// The probes' figure at the last pass, and the process generation it is of.
    probes: u64,
    generation: u64,
    /// When a pass first saw it.
    since: Option<Instant>,
    /// What the driver showed the pools do not keep of it.
    released: u64,
}

impl PoolsKeep {
    /// Takes the probes' figure (`probes`, of the process `generation`) at a pass at `now`.
    pub fn update(&mut self, probes: u64, generation: u64, now: Instant) {
        if generation != self.generation {
            *self = PoolsKeep { generation, ..PoolsKeep::default() };
        }
        if self.since.is_none() || probes != self.probes {
            self.probes = probes;
            self.since = Some(now);
        }
        self.released = self.released.min(self.probes);
    }

    /// What the pools may keep now.
    pub fn kept(&self) -> u64 {
        self.probes.saturating_sub(self.released)
    }

    /// A driver read that started at `read_at` says the process holds `room` bytes beyond
    /// the probes' live figure (on the probes' scale): if the probes' figure has not changed
    /// since before the read, the pools keep no more than that.
    pub fn read(&mut self, read_at: Instant, room: u64) {
        if self.since.is_some_and(|since| since <= read_at) {
            let kept = self.kept();
            if kept > room {
                self.released = self.released.saturating_add(kept - room).min(self.probes);
            }
        }
    }
}

/// A figure that must be seen on two consecutive driver reads before it is acted on: the
/// confirmed bytes are the smaller of what the two reads showed (a free between two reads,
/// or a process tearing down while the driver frees its memory, is seen on one only).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Confirmed {
    /// The read the figure is of (its start).
    read: Option<Instant>,
    /// The smallest figure seen on it, and on the read before it.
    now: u64,
    before: Option<u64>,
}

impl Confirmed {
    /// Takes `bytes` as what the read started at `read` shows (a pass may see one read more
    /// than once: the smallest counts); returns the confirmed bytes.
    pub fn see(&mut self, read: Option<Instant>, bytes: u64) -> u64 {
        if read != self.read || self.read.is_none() {
            self.before = self.read.map(|_| self.now);
            self.read = read;
            self.now = bytes;
        } else {
            self.now = self.now.min(bytes);
        }
        self.confirmed()
    }

    /// The bytes both reads showed.
    pub fn confirmed(&self) -> u64 {
        match (self.read, self.before) {
            (Some(_), Some(before)) => before.min(self.now),
            _ => 0,
        }
    }
}

/// A figure that moves only when two consecutive driver reads agree that it moved: up to the
/// smaller of the two, down to the larger ([`Confirmed`] keeps the two reads). One read that
/// caught a process low (a free, the read, the same allocation again, all between two passes)
/// does not lower it, as one read that caught it high does not raise it. Without a read it is 0.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Agreed {
    reads: Confirmed,
    value: u64,
}

impl Agreed {
    /// Takes `bytes` as what the read started at `read` shows; returns the figure.
    pub fn see(&mut self, read: Option<Instant>, bytes: u64) -> u64 {
        self.reads.see(read, bytes);
        self.value = match (self.reads.read, self.reads.before) {
            (Some(_), Some(before)) => {
                let (low, high) = (before.min(self.reads.now), before.max(self.reads.now));
                self.value.clamp(low, high)
            }
            (Some(_), None) => self.value,
            (None, _) => 0,
        };
        self.value
    }

    /// The figure.
    pub fn value(&self) -> u64 {
        self.value
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;
    const CTX: u64 = 64 * MIB;

    /// The figure of every case the issue names, at a 64 MiB allowance and a 64 MiB ledger
    /// reserve: (case, views, held, outside, unexplained).
    #[test]
    fn one_figure_per_process() {
        let driver = |bytes, devices| Some(DriverView { bytes, devices });
        let ledger = |bytes, extra_contexts| Some(LedgerView { bytes, extra_contexts, reserve: CTX });
        let page = DRIVER_PAGE;
        #[rustfmt::skip]
        let cases: [(&str, Views, u64, u64, u64); 13] = [
            ("probes alone, no driver row",
                Views { probes: GIB, ..Views::default() }, GIB, 0, 0),
            ("the three agree",
                Views { probes: GIB, ledger: ledger(GIB, 0), driver: driver(GIB + CTX, 1), ..Views::default() }, GIB, 0, 0),
            ("a pool keeps 2 GiB it freed (probes 0, pools 2 GiB): counted once",
                Views { pool_kept: 2 * GIB, driver: driver(2 * GIB + CTX, 1), ..Views::default() }, 2 * GIB, 0, 0),
            ("the pool's 2 GiB taken again, 256 MiB more: counted once",
                Views { probes: 2 * GIB + 256 * MIB, driver: driver(2 * GIB + 256 * MIB + CTX, 1), ..Views::default() }, 2 * GIB + 256 * MIB, 0, 0),
            ("the same, hooked: the ledger charges the pool's memory",
                Views { pool_kept: 2 * GIB, ledger: ledger(2 * GIB, 0), driver: driver(2 * GIB + CTX, 1), ..Views::default() }, 2 * GIB, 0, 0),
            ("a second context on one device, hooked: the ledger's second record explains it",
                Views { probes: 96 * MIB, ledger: ledger(96 * MIB, CTX), driver: driver(96 * MIB + 2 * CTX, 1), ..Views::default() }, 96 * MIB + CTX, CTX - page, 0),
            ("an array, hooked: the probes never see it, the ledger charges it",
                Views { ledger: ledger(100 * MIB, 0), driver: driver(100 * MIB + CTX, 1), ..Views::default() }, 100 * MIB, 100 * MIB - page, 0),
            ("graph memory beside probed memory, hooked",
                Views { probes: 64 * MIB, ledger: ledger(64 * MIB + 256 * MIB, 0), driver: driver(320 * MIB + CTX, 1), ..Views::default() }, 320 * MIB, 256 * MIB - page, 0),
            ("an escape: 96 MiB through a copy no probe is on, no slot",
                Views { driver: driver(96 * MIB + CTX, 1), ..Views::default() }, 96 * MIB - page, 96 * MIB - page, 96 * MIB + CTX),
            ("an escape beside a hooked, probed 96 MiB",
                Views { probes: 96 * MIB, ledger: ledger(96 * MIB, 0), driver: driver(192 * MIB + CTX, 1), ..Views::default() }, 192 * MIB - page, 96 * MIB - page, 96 * MIB),
            ("a slot forged up to the driver's figure: explains the charge, never the outside",
                Views { ledger: ledger(96 * MIB + CTX, 0), driver: driver(96 * MIB + CTX, 1), ..Views::default() }, 96 * MIB + CTX, 96 * MIB - page, 0),
            ("a huge reserve in the workload's own ledger explains no more than the allowance",
                Views { probes: 96 * MIB, ledger: Some(LedgerView { bytes: 96 * MIB, extra_contexts: 0, reserve: 1 << 40 }), driver: driver(660 * MIB, 1), ..Views::default() }, 660 * MIB - CTX - page, 500 * MIB - page, 500 * MIB),
            ("two devices, a context on each",
                Views { probes: GIB, driver: driver(GIB + 2 * CTX, 2), ..Views::default() }, GIB, 0, 0),
        ];
        for (case, views, held, outside, unexplained) in cases {
            assert_eq!(figure(&views, CTX), Figure { held, outside, unexplained }, "{case}");
        }
    }

    /// What an honest process holds beyond its allocations and the bare context its ledger
    /// charges (module images, local memory: 70 MiB for a PyTorch job on an H200 beside its
    /// 518 MiB context) is within the allowance: none of it is unexplained. Beyond the
    /// allowance and its page, all of it beyond the charged context is (a cliff of the
    /// allowance less the reserve, meant: what is beyond is not the context's).
    #[test]
    fn what_a_process_holds_beside_its_context_is_within_the_allowance() {
        let (allowance, reserve) = (600 * MIB, 518 * MIB);
        let hooked = |driver| Views {
            probes: 3 * GIB,
            ledger: Some(LedgerView { bytes: 3 * GIB, extra_contexts: 0, reserve }),
            driver: Some(DriverView { bytes: driver, devices: 1 }),
            ..Views::default()
        };
        let honest = figure(&hooked(3 * GIB + reserve + 70 * MIB), allowance);
        assert_eq!((honest.outside, honest.unexplained), (0, 0), "{honest:?}");
        let edge = figure(&hooked(3 * GIB + allowance + DRIVER_PAGE), allowance);
        assert_eq!(edge.unexplained, 0, "{edge:?}");
        let past = figure(&hooked(3 * GIB + allowance + DRIVER_PAGE + 1), allowance);
        assert_eq!(past.unexplained, allowance + DRIVER_PAGE + 1 - reserve, "{past:?}");
        let beyond = figure(&hooked(3 * GIB + reserve + 100 * MIB), allowance);
        assert_eq!((beyond.outside, beyond.unexplained), (16 * MIB, 100 * MIB), "{beyond:?}");
    }

    #[test]
    fn pools_keep_what_the_driver_still_holds() {
        let start = Instant::now();
        let at = |ms| start + Duration::from_millis(ms);
        let mut pools = PoolsKeep::default();
        // 2 GiB freed into a pool, seen at a pass; a read that started before the pass does
        // not lower it, whatever it shows (the free may be after it).
        pools.update(2 * GIB, 1, at(100));
        pools.read(at(50), 0);
        assert_eq!(pools.kept(), 2 * GIB);
        // A later read that shows it held: still kept.
        pools.read(at(1000), 2 * GIB);
        assert_eq!(pools.kept(), 2 * GIB);
        // A read that shows 1.5 GiB given back (a synchronize under a low release threshold):
        // 512 MiB kept, for good, while the probes' figure stays.
        pools.read(at(2000), 512 * MIB);
        pools.update(2 * GIB, 1, at(2100));
        pools.read(at(3000), 2 * GIB);
        assert_eq!(pools.kept(), 512 * MIB);
        // A new allocation takes 1 GiB from the pools' figure: what was given back goes first.
        pools.update(GIB, 1, at(3100));
        assert_eq!(pools.kept(), 0);
        // 1 GiB more freed into them: kept again until a read says otherwise.
        pools.update(2 * GIB, 1, at(3200));
        assert_eq!(pools.kept(), GIB);
        // A new process with the pid starts over.
        pools.update(0, 2, at(3300));
        assert_eq!(pools.kept(), 0);
    }

    #[test]
    fn a_figure_moves_once_two_reads_agree() {
        let start = Instant::now();
        let read = |s| Some(start + Duration::from_secs(s));
        let mut a = Agreed::default();
        assert_eq!(a.see(read(0), 100), 0, "one read");
        assert_eq!(a.see(read(1), 80), 80, "two reads above it: the smaller");
        assert_eq!(a.see(read(2), 10), 80, "one read below it");
        assert_eq!(a.see(read(3), 90), 80, "the two reads either side of it");
        assert_eq!(a.see(read(4), 95), 90, "two above: the smaller");
        assert_eq!(a.see(read(5), 20), 90);
        assert_eq!(a.see(read(6), 30), 30, "two below: the larger");
        assert_eq!(a.see(read(6), 25), 25, "the same read again: the smaller of what it showed");
        assert_eq!(a.see(None, 50), 0, "no read");
    }

    #[test]
    fn a_figure_counts_once_two_reads_show_it() {
        let start = Instant::now();
        let read = |s| Some(start + Duration::from_secs(s));
        let mut c = Confirmed::default();
        assert_eq!(c.see(read(0), 100), 0, "one read");
        assert_eq!(c.see(read(0), 120), 0, "the same read again");
        assert_eq!(c.see(read(1), 80), 80, "two reads: the smaller");
        assert_eq!(c.see(read(2), 0), 0, "a read without it");
        assert_eq!(c.see(read(3), 50), 0, "starts over");
        assert_eq!(c.see(None, 50), 0, "no read");
    }
}
